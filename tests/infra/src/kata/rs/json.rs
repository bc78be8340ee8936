//! JSON with its keys in the order given, written as `serde_json` writes a
//! derived struct (`to_string` and `to_string_pretty`): runtime-rs's bodies
//! are the serde output of its structs, keys in field order, which a
//! `serde_json::Value` (keys sorted) cannot reproduce.

use serde_json::Value;

/// A JSON value whose objects keep their keys in the order written.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Int(i64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(&'static str, Json)>),
}

impl Json {
    pub fn str(s: impl Into<String>) -> Json {
        Json::Str(s.into())
    }

    pub fn uint(n: u64) -> Json {
        Json::Int(i64::try_from(n).expect("the bodies' numbers fit i64"))
    }

    /// `Some(n)` as a number, `None` as `null` (an `Option` field serde
    /// writes without `skip_serializing_if`).
    pub fn opt_uint(n: Option<u64>) -> Json {
        n.map_or(Json::Null, Json::uint)
    }

    /// The value at `key` of an object (None for anything else).
    pub fn get_mut(&mut self, key: &str) -> Option<&mut Json> {
        match self {
            Json::Obj(fields) => fields.iter_mut().find(|(k, _)| *k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The same value as `serde_json` sees it (keys sorted).
    pub fn to_value(&self) -> Value {
        match self {
            Json::Null => Value::Null,
            Json::Bool(b) => Value::Bool(*b),
            Json::Int(n) => Value::from(*n),
            Json::Str(s) => Value::String(s.clone()),
            Json::Arr(a) => Value::Array(a.iter().map(Json::to_value).collect()),
            Json::Obj(o) => Value::Object(
                o.iter()
                    .map(|(k, v)| ((*k).to_string(), v.to_value()))
                    .collect(),
            ),
        }
    }

    /// `serde_json::to_string`.
    pub fn compact(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, None, 0);
        out
    }

    /// `serde_json::to_string_pretty`: two spaces a level, `": "` after a
    /// key, empty arrays and objects as `[]` and `{}`.
    pub fn pretty(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, Some("  "), 0);
        out
    }

    fn write(&self, out: &mut String, indent: Option<&str>, level: usize) {
        let newline = |out: &mut String, level: usize| {
            if let Some(i) = indent {
                out.push('\n');
                out.push_str(&i.repeat(level));
            }
        };
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Int(n) => out.push_str(&n.to_string()),
            Json::Str(s) => write_string(s, out),
            Json::Arr(items) if items.is_empty() => out.push_str("[]"),
            Json::Obj(fields) if fields.is_empty() => out.push_str("{}"),
            Json::Arr(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    newline(out, level + 1);
                    item.write(out, indent, level + 1);
                }
                newline(out, level);
                out.push(']');
            }
            Json::Obj(fields) => {
                out.push('{');
                for (i, (k, v)) in fields.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    newline(out, level + 1);
                    write_string(k, out);
                    out.push(':');
                    if indent.is_some() {
                        out.push(' ');
                    }
                    v.write(out, indent, level + 1);
                }
                newline(out, level);
                out.push('}');
            }
        }
    }
}

/// serde_json's string escapes: `"`, `\`, the short forms of control
/// characters, `\u00xx` for the rest below 0x20; nothing else.
fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With keys already sorted, the output is byte for byte serde_json's.
    #[test]
    fn written_as_serde_json_writes_it() {
        let j = Json::Obj(vec![
            ("a", Json::Arr(vec![])),
            (
                "b",
                Json::Arr(vec![
                    Json::Obj(vec![("x", Json::Int(1)), ("y", Json::Null)]),
                    Json::Int(-2),
                ]),
            ),
            ("c", Json::Obj(vec![])),
            ("d", Json::str("q\"\\\n\u{1}é/<")),
            ("e", Json::Bool(false)),
        ]);
        let v = j.to_value();
        assert_eq!(j.pretty(), serde_json::to_string_pretty(&v).unwrap());
        assert_eq!(j.compact(), serde_json::to_string(&v).unwrap());
    }

    #[test]
    fn keys_keep_their_order() {
        let j = Json::Obj(vec![("z", Json::Int(1)), ("a", Json::Int(2))]);
        assert_eq!(j.compact(), r#"{"z":1,"a":2}"#);
        assert_eq!(j.pretty(), "{\n  \"z\": 1,\n  \"a\": 2\n}");
        let mut j = j;
        *j.get_mut("a").unwrap() = Json::Null;
        assert_eq!(j.compact(), r#"{"z":1,"a":null}"#);
        assert!(j.get_mut("b").is_none());
    }
}
