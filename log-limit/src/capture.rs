//! A subscriber for tests: every event each thread logs is kept (its level
//! and message), so a test can count what a device path or a request
//! produced. Installed as the process's default once per test binary.

use std::cell::RefCell;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

use crate::stderr::message_of;

thread_local! {
    static RECORDS: RefCell<Vec<(Level, String)>> = const { RefCell::new(Vec::new()) };
}

struct Capture;

impl<S: Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let message = message_of(event);
        RECORDS.with(|r| r.borrow_mut().push((*event.metadata().level(), message)));
    }
}

/// Installs the subscriber (once per process) and forgets what this thread
/// logged so far.
pub fn start() {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Capture))
            .expect("no other subscriber in the test binary");
    });
    RECORDS.with(|r| r.borrow_mut().clear());
}

/// What this thread logged since [`start`], in order.
pub fn take() -> Vec<(Level, String)> {
    RECORDS.with(|r| std::mem::take(&mut *r.borrow_mut()))
}
