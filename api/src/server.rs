//! The API's unix socket and the thread that serves it.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
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
    // Bound and listening under a temporary name, then renamed into place:
    // whoever waits for the path to appear (an orchestrator polling for
    // it) can connect at once, instead of finding a socket bound but not
    // yet listening (ECONNREFUSED). Where the longer name does not fit in
    // a socket address, the path is bound directly.
    let mut staged = path.as_os_str().to_owned();
    staged.push(".new");
    let staged = PathBuf::from(staged);
    let _ = std::fs::remove_file(&staged);
    let (listener, bound) = match bind_0600(&staged) {
        Ok(l) => (l, staged.as_path()),
        Err(_) => (bind_0600(path).map_err(|e| io("bind", e))?, path),
    };
    // Belt and braces, should the umask have been raced by another thread.
    std::fs::set_permissions(bound, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| io("chmod 0600", e))?;
    if bound != path {
        std::fs::rename(bound, path).map_err(|e| io("rename into place", e))?;
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| io("set_nonblocking", e))?;
    Ok(listener)
}

/// Binds (and listens on) `path`, created 0600 from the start (umask), not
/// chmod-ed after others could connect.
fn bind_0600(path: &Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    // SAFETY: umask only changes this process's file-creation mask; it is
    // restored right after the bind.
    let old = unsafe { libc::umask(0o177) };
    let listener = std::os::unix::net::UnixListener::bind(path);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    listener
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
        let (app, state) = crate::routes::app(vmm, events, ping);
        let thread = std::thread::Builder::new()
            .name("api".into())
            .spawn(move || {
                if let Err(e) = seccomp::enter_thread(crate::API_THREAD) {
                    return log::error!("API: {e}; the API is not served");
                }
                runtime.block_on(async move {
                    let listener = match tokio::net::UnixListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            log::error!("API socket: {e}");
                            return;
                        }
                    };
                    tokio::spawn(crate::dax::reconcile(state));
                    crate::http1::serve(listener, app, async {
                        let _ = stop.await;
                    })
                    .await;
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
