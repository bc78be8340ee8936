//! The API's unix socket and the thread that serves it.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use crate::{EventBus, VmmChannel};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("--api-socket {path}: another process is listening there")]
    InUse { path: String },
    #[error("--api-socket {path}: {what}: {source}")]
    Io {
        path: String,
        what: &'static str,
        source: std::io::Error,
    },
}

/// The running API: stopped and its socket removed when dropped.
pub struct ApiServer {
    path: PathBuf,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

/// Binds `path` with mode 0600: only the VMM's user may drive the VM.
///
/// A socket file left by a VMM that died is replaced; one that still has a
/// listener is not.
fn bind(path: &Path) -> Result<std::os::unix::net::UnixListener, ServerError> {
    let shown = path.display().to_string();
    let io = |what, source| ServerError::Io {
        path: shown.clone(),
        what,
        source,
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(io(
                "exists and is not a socket",
                std::io::Error::from_raw_os_error(libc::EEXIST),
            ));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(ServerError::InUse { path: shown });
        }
        std::fs::remove_file(path).map_err(|e| io("removing a stale socket", e))?;
    }
    control_protocol::listener::bind_owner_only(path).map_err(|(what, e)| io(what, e))
}

impl ApiServer {
    /// Binds the socket (in the caller's thread, so errors are reported at
    /// start-up) and serves it on a thread of its own.
    /// `ping` is what `vmm.ping` answers.
    pub fn start(
        path: &Path,
        vmm: VmmChannel,
        events: EventBus,
        ping: serde_json::Value,
    ) -> Result<ApiServer, ServerError> {
        let listener = bind(path)?;
        let shown = path.display().to_string();
        let io = |what, source| ServerError::Io {
            path: shown.clone(),
            what,
            source,
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| io("starting the runtime", e))?;
        let (shutdown, stop) = oneshot::channel::<()>();
        let (app, controller) = crate::routes::app(vmm, events, ping);
        let thread = std::thread::Builder::new()
            .name("api".into())
            .spawn(move || {
                if let Err(e) = seccomp::enter_thread(crate::API_THREAD) {
                    return tracing::error!("API: {e}; the API is not served");
                }
                runtime.block_on(async move {
                    let listener = match tokio::net::UnixListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!("API socket: {e}");
                            return;
                        }
                    };
                    tokio::spawn(crate::dax::deliver_truncations(controller.clone()));
                    tokio::spawn(crate::dax::run(controller));
                    let stop = async {
                        let _ = stop.await;
                    };
                    crate::http1::serve(listener, app, stop, crate::http1::Limits::default()).await;
                })
            })
            .map_err(|e| io("starting the API thread", e))?;
        Ok(ApiServer {
            path: path.to_path_buf(),
            shutdown: Some(shutdown),
            thread: Some(thread),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        let _ = std::fs::remove_file(&self.path);
        // Graceful shutdown lets answers in flight (vmm.shutdown's own) reach
        // their clients; bounded, since an event-stream subscriber would hold
        // it open for ever.
        if let Some(thread) = self.thread.take() {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
            while !thread.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            if thread.is_finished() {
                let _ = thread.join();
            }
        }
    }
}
