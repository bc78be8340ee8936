//! DAX policy documents (JSON and YAML): parsing never panics, and what
//! parses serializes back to a document that parses to the same policy
//! with no difference.
#![no_main]

use libfuzzer_sys::fuzz_target;
use policies::Policy;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for p in [Policy::parse_json(text), Policy::parse_yaml(text)]
        .into_iter()
        .flatten()
    {
        let again = Policy::from_value(&p.to_value()).expect("a policy's own document parses");
        assert!(
            policies::diff(&p, &again).is_empty(),
            "round trip changed the policy"
        );
    }
});
