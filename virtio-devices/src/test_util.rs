//! What the devices' unit tests share.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Mutex;

use vmm_sys_util::eventfd::EventFd;

use crate::device::{Interrupt, VirtioInterrupt};

/// Interrupts sent to a channel, for a test to wait on.
pub(crate) struct ChannelInterrupt(pub(crate) Mutex<Sender<Interrupt>>);

impl VirtioInterrupt for ChannelInterrupt {
    fn trigger(&self, interrupt: Interrupt) -> std::io::Result<()> {
        let _ = self.0.lock().unwrap().send(interrupt);
        Ok(())
    }
    fn notifier(&self, _: Interrupt) -> Option<EventFd> {
        None
    }
}

/// Interrupts counted, for a test that only needs to know some came.
#[derive(Default)]
pub(crate) struct CountingInterrupt(pub(crate) AtomicUsize);

impl VirtioInterrupt for CountingInterrupt {
    fn trigger(&self, _: Interrupt) -> std::io::Result<()> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn notifier(&self, _: Interrupt) -> Option<EventFd> {
        None
    }
}
