//! What the agent asks of one VMM, over its REST API socket: the VM's fs
//! devices (`vm.info`), and a policy put (`PUT vm.dax-policy`) or taken
//! back (`DELETE`). Both answer the generation the device's daemon
//! acknowledged; the same document twice makes no new generation.

use std::path::Path;

use serde_json::Value;

/// The ids of the VM's fs devices.
pub async fn fs_ids(socket: &Path) -> Result<Vec<String>, String> {
    let info = call(socket, "GET", "/api/v1/vm.info", None).await?;
    let list = info["config"]["fs"].as_array().cloned().unwrap_or_default();
    Ok(list
        .iter()
        .filter_map(|fs| fs["id"].as_str().map(str::to_string))
        .collect())
}

/// Puts `policy` (None: the daemon's default) on fs device `id`; answers
/// the generation the daemon acknowledged.
pub async fn apply(socket: &Path, id: &str, policy: Option<&Value>) -> Result<u64, String> {
    let uri = format!("/api/v1/vm.dax-policy?id={}", encode(id));
    let answer = match policy {
        Some(p) => call(socket, "PUT", &uri, Some(p.to_string())).await?,
        None => call(socket, "DELETE", &uri, None).await?,
    };
    answer["generation"]
        .as_u64()
        .ok_or_else(|| format!("vm.dax-policy answered without a generation: {answer}"))
}

/// Percent-encodes a query value (device ids are short names; anything
/// outside unreserved characters is escaped).
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One request; a non-2xx answer is an error carrying the API's message
/// (which names the field for a refused policy).
async fn call(
    socket: &Path,
    method: &str,
    uri: &str,
    body: Option<String>,
) -> Result<Value, String> {
    let a = api::client::request(socket, method, uri, body)
        .await
        .map_err(|e| format!("VMM API: {e}"))?;
    if !(200..300).contains(&a.status) {
        return Err(format!(
            "VMM API {method} {uri}: {} {}",
            a.status,
            a.body.trim()
        ));
    }
    if a.body.trim().is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_str(&a.body).map_err(|e| format!("VMM API {method} {uri}: {e}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn query_values_are_escaped() {
        assert_eq!(super::encode("fs0"), "fs0");
        assert_eq!(super::encode("a b&c"), "a%20b%26c");
    }
}
