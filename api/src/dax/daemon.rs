//! The client of one fs device's daemon, over its control socket: the
//! control protocol's requests as typed calls. An answer that is not 200
//! (or 204 for a notice), or not the protocol's type, is a 502 that carries
//! the daemon's own message.

use std::path::{Path, PathBuf};

use control_protocol::{
    AdaptiveEvents, DaemonStats, PolicyState, PolicyUpdate, ADAPTIVE_EVENTS, POLICY, STATS,
    WINDOW_LOCATION, WINDOW_TRUNCATED,
};
use serde_json::Value;

use super::DaemonNotice;
use crate::client;
use crate::ApiError;

/// How a notice did not reach a daemon.
#[derive(Debug)]
pub(crate) enum NoticeFailure {
    /// It answered, but not 204.
    Answered {
        status: u16,
        body: String,
    },
    Unreachable(client::ClientError),
}

impl std::fmt::Display for NoticeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoticeFailure::Answered { status, body } => {
                write!(f, "the daemon answered {status}: {body}")
            }
            NoticeFailure::Unreachable(e) => e.fmt(f),
        }
    }
}

/// One daemon, by its control socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Daemon {
    socket: PathBuf,
}

impl Daemon {
    pub fn at(socket: &Path) -> Self {
        Daemon {
            socket: socket.to_path_buf(),
        }
    }

    /// Sends one request; its answer as the control protocol's type `T`.
    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        method: &str,
        uri: &str,
        body: Option<String>,
    ) -> Result<T, ApiError> {
        let answer = client::request(&self.socket, method, uri, body)
            .await
            .map_err(|e| ApiError::bad_gateway(e.to_string()))?;
        if answer.status != 200 {
            return Err(ApiError::bad_gateway(format!(
                "the daemon at {} answered {}: {}",
                self.socket.display(),
                answer.status,
                answer.body.trim()
            )));
        }
        serde_json::from_str(&answer.body).map_err(|e| {
            ApiError::bad_gateway(format!(
                "the daemon at {} answered something the control protocol does not know: {e}",
                self.socket.display()
            ))
        })
    }

    fn policy_uri(dry_run: bool) -> String {
        if dry_run {
            format!("{POLICY}?dry_run=true")
        } else {
            POLICY.to_string()
        }
    }

    /// The policy in force and its generation.
    pub async fn policy(&self) -> Result<PolicyState, ApiError> {
        self.json("GET", POLICY, None).await
    }

    /// Puts `doc` in force (a dry run: says what would change).
    pub async fn put_policy(&self, doc: &Value, dry_run: bool) -> Result<PolicyUpdate, ApiError> {
        self.json("PUT", &Self::policy_uri(dry_run), Some(doc.to_string()))
            .await
    }

    /// Back to the daemon's own default: the policy it started with.
    pub async fn reset_policy(&self, dry_run: bool) -> Result<PolicyUpdate, ApiError> {
        self.json("DELETE", &Self::policy_uri(dry_run), None).await
    }

    pub async fn stats(&self) -> Result<DaemonStats, ApiError> {
        self.json("GET", STATS, None).await
    }

    /// The adaptive policy's decisions numbered above `after`.
    pub async fn adaptive_events(&self, after: u64) -> Result<AdaptiveEvents, ApiError> {
        self.json("GET", &format!("{ADAPTIVE_EVENTS}?after={after}"), None)
            .await
    }

    /// A notice the daemon acknowledges with 204.
    async fn notice(&self, method: &str, uri: &str, body: String) -> Result<(), NoticeFailure> {
        match client::request(&self.socket, method, uri, Some(body)).await {
            Ok(a) if a.status == 204 => Ok(()),
            Ok(a) => Err(NoticeFailure::Answered {
                status: a.status,
                body: a.body,
            }),
            Err(e) => Err(NoticeFailure::Unreachable(e)),
        }
    }

    /// One notice, as the control protocol carries it: the window's
    /// location is `PUT` (it replaces the last), a truncation `POST`ed.
    pub async fn tell(&self, notice: &DaemonNotice) -> Result<(), NoticeFailure> {
        match notice {
            DaemonNotice::Location(loc) => {
                let body = serde_json::to_string(loc).unwrap_or_default();
                self.notice("PUT", WINDOW_LOCATION, body).await
            }
            DaemonNotice::Truncated(t) => {
                let body = serde_json::to_string(t).unwrap_or_default();
                self.notice("POST", WINDOW_TRUNCATED, body).await
            }
        }
    }
}
