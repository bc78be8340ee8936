//! What the agent asks of one VMM, over its REST API socket: the VM's fs
//! devices (`vm.info`), and a policy put (`PUT vm.dax-policy`) or taken
//! back (`DELETE`). Both answer the generation the device's daemon
//! acknowledged; the same document twice makes no new generation. For a
//! drain: whether a spare VMM holds a VM, and the two migration calls,
//! each answered only once the migration is over.

use std::path::Path;
use std::time::Duration;

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

/// Whether the VMM has a VM (`vm.info` answers 409 on an empty one).
pub async fn has_vm(socket: &Path) -> Result<bool, String> {
    let a = api::client::request(socket, "GET", "/api/v1/vm.info", None)
        .await
        .map_err(|e| format!("VMM API: {e}"))?;
    match a.status {
        200..=299 => Ok(true),
        409 => Ok(false),
        s => Err(format!(
            "VMM API GET /api/v1/vm.info: {s} {}",
            a.body.trim()
        )),
    }
}

/// `vm.send-migration` to `url`; answered when the VM has moved (or not).
pub async fn send_migration(socket: &Path, url: &str, patience: Duration) -> Result<(), String> {
    let body = serde_json::json!({ "destination_url": url }).to_string();
    call_within(
        socket,
        "PUT",
        "/api/v1/vm.send-migration",
        Some(body),
        patience,
    )
    .await
    .map(|_| ())
}

/// `vm.receive-migration` listening at `url`; answered when a VM has
/// arrived (or not).
pub async fn receive_migration(socket: &Path, url: &str, patience: Duration) -> Result<(), String> {
    let body = serde_json::json!({ "receiver_url": url }).to_string();
    call_within(
        socket,
        "PUT",
        "/api/v1/vm.receive-migration",
        Some(body),
        patience,
    )
    .await
    .map(|_| ())
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
    call_within(
        socket,
        method,
        uri,
        body,
        api::client::CONTROL_SOCKET_TIMEOUT,
    )
    .await
}

async fn call_within(
    socket: &Path,
    method: &str,
    uri: &str,
    body: Option<String>,
    patience: Duration,
) -> Result<Value, String> {
    let limit = api::client::MAX_REPLY_BYTES;
    let a = api::client::request_within(socket, method, uri, body, limit, patience)
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
