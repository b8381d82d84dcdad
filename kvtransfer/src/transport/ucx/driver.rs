//! Drives a UCX worker from a current-thread tokio runtime on its own
//! thread: progress whenever the worker's event fd fires, then poll
//! whatever the thread is waiting for.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::pin;
use std::rc::Rc;
use std::task::Poll;

use tokio::io::unix::AsyncFd;
use ucx_sys::{AmMessage, EventFd, Worker};

use super::wire::{Msg, WireError};

/// One decoded active message, or the bytes that did not decode.
pub(super) type Inbound = Result<(u64, Msg), WireError>;

/// A worker, its event fd in tokio's reactor, and the active messages that
/// arrived for `am_id` (queued by the handler during progress).
pub(super) struct Driver {
    fd: AsyncFd<EventFd>,
    pub(super) worker: Worker,
    inbox: Rc<RefCell<VecDeque<Inbound>>>,
}

impl Driver {
    /// Must run inside the thread's tokio runtime (the fd joins its reactor).
    pub(super) fn new(worker: Worker, am_id: u16) -> Result<Self, String> {
        let fd = worker.async_event_fd().map_err(|e| format!("registering the UCX event fd: {e}"))?;
        let inbox: Rc<RefCell<VecDeque<Inbound>>> = Rc::default();
        let queue = inbox.clone();
        worker
            .on_am(am_id, move |m: AmMessage<'_>| {
                // Control messages are small and sent eager; a rendezvous one is malformed.
                let msg = match m.data {
                    Some(body) => Msg::decode(m.header, body),
                    None => Err(WireError::Rendezvous),
                };
                queue.borrow_mut().push_back(msg);
            })
            .map_err(|e| e.to_string())?;
        Ok(Self { fd, worker, inbox })
    }

    /// The next queued message, if one arrived.
    pub(super) fn pop(&self) -> Option<Inbound> {
        self.inbox.borrow_mut().pop_front()
    }

    pub(super) fn has_mail(&self) -> bool {
        !self.inbox.borrow().is_empty()
    }

    /// Runs `fut` to completion, progressing the worker before every poll
    /// and sleeping on the event fd (armed) when neither has anything to do.
    /// Futures that wait on UCX (requests, the inbox) are woken this way; any
    /// other waker (timers, channels) wakes the whole thing too.
    pub(super) async fn run<F: Future>(&self, fut: F) -> F::Output {
        let mut fut = pin!(fut);
        poll_fn(|cx| loop {
            while self.worker.progress() > 0 {}
            if let Poll::Ready(v) = fut.as_mut().poll(cx) {
                return Poll::Ready(v);
            }
            match self.worker.arm() {
                Ok(true) => {}
                // Events pending: progress again.
                Ok(false) => continue,
                Err(_) => {
                    // Cannot sleep on the fd: yield, and come back to progress.
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
            }
            match self.fd.poll_read_ready(cx) {
                Poll::Ready(Ok(mut ready)) => ready.clear_ready(),
                Poll::Ready(Err(_)) => {
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Poll::Pending => return Poll::Pending,
            }
        })
        .await
    }
}

/// Resolves once the inbox holds a message (to be used inside [`Driver::run`],
/// which progresses the worker before every poll).
pub(super) async fn mail(d: &Driver) {
    poll_fn(|_| if d.has_mail() { Poll::Ready(()) } else { Poll::Pending }).await
}
