//! Entity tags for `vm.dax-policy`: a daemon's policy generation as an
//! `ETag`, and what an `If-Match` header asks for (RFC 9110, 13.1.1).

use axum::http::{header, HeaderMap};

/// A generation as an entity tag.
pub(crate) fn etag(generation: u64) -> String {
    format!("\"{generation}\"")
}

/// What an `If-Match` header asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum IfMatch {
    /// `*`: any generation.
    Any,
    /// A list of entity tags: the opaque text of the strong ones. A weak
    /// tag (`W/"…"`) never matches: If-Match compares strongly.
    Tags(Vec<String>),
}

impl IfMatch {
    pub fn matches(&self, generation: u64) -> bool {
        match self {
            IfMatch::Any => true,
            IfMatch::Tags(tags) => tags.iter().any(|t| *t == generation.to_string()),
        }
    }
}

/// The `If-Match` header(s), None without one. A value that is not `*` or
/// a list of entity tags (`"<text>"` or `W/"<text>"`) names no entity tag
/// of ours, so it matches no generation: the precondition fails (412, whose
/// message shows how the tag is written) rather than the request being
/// malformed; any string is a valid If-Match to send.
pub(crate) fn if_match(headers: &HeaderMap) -> Option<IfMatch> {
    let mut tags = Vec::new();
    let mut seen = false;
    for value in headers.get_all(header::IF_MATCH) {
        seen = true;
        let Ok(v) = value.to_str() else {
            continue;
        };
        if v.trim() == "*" {
            return Some(IfMatch::Any);
        }
        tags.extend(strong_entity_tags(v).unwrap_or_default());
    }
    seen.then_some(IfMatch::Tags(tags))
}

/// The opaque text of the strong tags in an RFC 9110 entity-tag list;
/// None if `v` is not one.
fn strong_entity_tags(v: &str) -> Option<Vec<String>> {
    let mut tags = Vec::new();
    let mut listed = false;
    let mut rest = v;
    loop {
        rest = rest.trim_start_matches([' ', '\t', ',']);
        if rest.is_empty() {
            break;
        }
        let (weak, quoted) = match rest.strip_prefix("W/") {
            Some(r) => (true, r),
            None => (false, rest),
        };
        let opaque = quoted.strip_prefix('"')?;
        let end = opaque.find('"')?;
        let text = &opaque[..end];
        // etagc: visible characters but DQUOTE.
        if !text.bytes().all(|b| b.is_ascii_graphic()) {
            return None;
        }
        if !weak {
            tags.push(text.to_string());
        }
        listed = true;
        rest = opaque[end + 1..].trim_start_matches([' ', '\t']);
        if !rest.is_empty() && !rest.starts_with(',') {
            return None;
        }
    }
    listed.then_some(tags)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn if_match_reads_rfc_9110_entity_tag_lists_and_matches_strongly() {
        let with = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(header::IF_MATCH, v.parse().unwrap());
            }
            if_match(&h)
        };
        let tags = |t: &[&str]| Some(IfMatch::Tags(t.iter().map(|s| s.to_string()).collect()));
        assert_eq!(if_match(&HeaderMap::new()), None);
        assert_eq!(with(&["\"7\""]), tags(&["7"]));
        assert_eq!(with(&["*"]), Some(IfMatch::Any));
        // What a generic client (or a fuzzer) may send: valid, and simply
        // not the daemon's generation.
        assert_eq!(with(&["\"x\", W/\"7\",\"a,b\""]), tags(&["x", "a,b"]));
        assert_eq!(with(&["\"1\"", "\"2\""]), tags(&["1", "2"]));
        assert_eq!(with(&["\"\""]), tags(&[""]));
        let seven = with(&["\"9\", \"7\""]).unwrap();
        assert!(seven.matches(7) && !seven.matches(8));
        let weak = with(&["W/\"7\""]).unwrap();
        assert!(!weak.matches(7), "If-Match compares strongly");
        assert!(IfMatch::Any.matches(3));
        // Not entity tags (the bare `0` is what the fuzzer sent): they
        // match no generation, so the precondition fails (412), never a
        // 400 for a string the schema allows.
        for other in ["7", "0", "\"7", "\"1\" \"2\"", ",", "W/7", "\"a b\""] {
            let got = with(&[other]).unwrap();
            assert_eq!(got, IfMatch::Tags(Vec::new()), "{other}");
            assert!(!got.matches(7) && !got.matches(0), "{other}");
        }
        assert_eq!(etag(7), "\"7\"");
    }
}
