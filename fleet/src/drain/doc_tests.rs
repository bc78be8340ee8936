use super::*;

#[test]
fn a_drain_document_parses() {
    let d = DrainDoc::parse(
        "h1",
        br#"{"selector": {"tier": "build"}, "destinations": ["h2", "h3"]}"#,
    )
    .unwrap();
    assert_eq!(d.selector["tier"], "build");
    assert_eq!(d.destinations, ["h2", "h3"]);
    let all = DrainDoc::parse("h1", br#"{"destinations": ["h2"]}"#).unwrap();
    assert!(all.selector.is_empty(), "no selector: every VM");
}

#[test]
fn drain_errors_name_the_field() {
    for (doc, want) in [
        ("{nope", "drain of \"h1\": not a JSON object: "),
        (
            "[]",
            "drain of \"h1\": not a JSON object: [] is not an object",
        ),
        (
            r#"{"selector": {}}"#,
            "drain of \"h1\": destinations: is required",
        ),
        (
            r#"{"destinations": []}"#,
            "drain of \"h1\": destinations: must name at least one host",
        ),
        (
            r#"{"destinations": "h2"}"#,
            "drain of \"h1\": destinations: must be a list",
        ),
        (
            r#"{"destinations": ["h2", 3]}"#,
            "drain of \"h1\": destinations[1]: 3 is not a host name",
        ),
        (
            r#"{"destinations": ["h2", "h1"]}"#,
            "drain of \"h1\": destinations[1]: \"h1\" is the host drained",
        ),
        (
            r#"{"destinations": ["h2", "h2"]}"#,
            "drain of \"h1\": destinations[1]: \"h2\" is listed twice",
        ),
        (
            r#"{"destinations": ["a/b"]}"#,
            "drain of \"h1\": destinations[0]: \"a/b\" must be 1 to 253 characters",
        ),
        (
            r#"{"selector": {"tier": 1}, "destinations": ["h2"]}"#,
            "drain of \"h1\": selector.tier: 1 is not a string",
        ),
        (
            r#"{"destinations": ["h2"], "dest": 1}"#,
            "drain of \"h1\": dest: unknown field (accepted: selector, destinations)",
        ),
    ] {
        let e = DrainDoc::parse("h1", doc.as_bytes())
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(want), "{doc}\n  got:  {e}\n  want: {want}");
    }
}

#[test]
fn a_request_and_its_answers_round_trip() {
    let mut r = Incoming {
        from: "h1".into(),
        labels: [("tier".to_string(), "build".to_string())].into(),
        answer: None,
    };
    assert_eq!(
        Incoming::parse("h2", "vm1", r.to_json().as_bytes()).unwrap(),
        r
    );
    r.answer = Some(Answer::Receiver("tcp:10.0.0.2:6000".into()));
    assert_eq!(
        Incoming::parse("h2", "vm1", r.to_json().as_bytes()).unwrap(),
        r
    );
    r.answer = Some(Answer::Refused("no spare free".into()));
    assert_eq!(
        Incoming::parse("h2", "vm1", r.to_json().as_bytes()).unwrap(),
        r
    );
    for (doc, want) in [
        (r#"{"labels": {}}"#, "from: is required"),
        (
            r#"{"from": "h1", "labels": {"a": true}}"#,
            "labels.a: true is not a string",
        ),
        (
            r#"{"from": "h1", "receiver_url": "tcp:a:1", "error": "x"}"#,
            "receiver_url: and error: an answer has one or the other",
        ),
        (r#"{"from": "h1", "url": 1}"#, "url: unknown field"),
        (r#"{"from": 7}"#, "from: 7 is not a string"),
    ] {
        let e = Incoming::parse("h2", "vm1", doc.as_bytes())
            .unwrap_err()
            .to_string();
        let want = format!("request for \"vm1\" to \"h2\": {want}");
        assert!(e.starts_with(&want), "{doc}\n  got:  {e}\n  want: {want}");
    }
    let e = Incoming::parse("h2", "a/b", br#"{"from": "h1"}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(r#"request for "a/b" to "h2": the key's VM name: "a/b" must be"#),
        "{e}"
    );
}

#[test]
fn a_drain_status_round_trips_and_names_what_is_wrong() {
    let s = DrainStatus {
        state: State::WaitingReceiver,
        destination: Some("h2".into()),
        error: None,
        drain_revision: 7,
    };
    let json = s.to_json();
    assert!(json.contains(r#""state":"waiting-receiver""#), "{json}");
    assert_eq!(DrainStatus::parse("vm1", json.as_bytes()).unwrap(), s);
    let e = DrainStatus::parse("vm1", br#"{"state": "lost", "drain_revision": 1}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("drain status of \"vm1\": not a JSON object: unknown variant `lost`"),
        "{e}"
    );
}

#[test]
fn placement_takes_the_fewest_sent_then_the_lowest_name_and_skips_full_hosts() {
    let dests: Vec<String> = ["h3", "h2", "h4"].iter().map(|s| s.to_string()).collect();
    let mut sent = BTreeMap::new();
    let mut full = BTreeSet::new();
    assert_eq!(place(&dests, &sent, &full), Some("h2"), "ties: lowest name");
    sent.insert("h2".to_string(), 1);
    assert_eq!(place(&dests, &sent, &full), Some("h3"));
    sent.insert("h3".to_string(), 1);
    sent.insert("h4".to_string(), 1);
    assert_eq!(place(&dests, &sent, &full), Some("h2"));
    full.insert("h2".to_string());
    assert_eq!(place(&dests, &sent, &full), Some("h3"), "h2 has no spare");
    full.insert("h3".to_string());
    full.insert("h4".to_string());
    assert_eq!(place(&dests, &sent, &full), None, "every host full");
}
