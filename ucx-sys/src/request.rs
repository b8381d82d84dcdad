//! Operations in flight: UCX's request handles as futures, and the buffers
//! they keep owned until UCX is done with them.

use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context as TaskContext, Poll, Waker};

use crate::raw::{self, ucs_status_t};
use crate::{check, Result, WorkerInner};

pub(crate) fn is_request(p: raw::ucs_status_ptr_t) -> bool {
    // UCS_PTR_IS_PTR: neither NULL (done) nor an encoded error (>= (uintptr_t)UCS_ERR_LAST).
    !p.is_null() && (p as usize) < (ucs_status_t::UCS_ERR_LAST as isize as usize)
}

fn ptr_status(p: raw::ucs_status_ptr_t) -> ucs_status_t {
    if p.is_null() {
        return ucs_status_t::UCS_OK;
    }
    // UCS_PTR_STATUS: an error pointer is the status value, sign-extended. The value is
    // looked up among the declared statuses (never transmuted): one UCX does not
    // declare reads as an I/O error.
    let v = p as isize as i32;
    STATUSES.iter().copied().find(|s| *s as i32 == v).unwrap_or(ucs_status_t::UCS_ERR_IO_ERROR)
}

const STATUSES: &[ucs_status_t] = {
    use ucs_status_t::*;
    &[
        UCS_ERR_NO_MESSAGE,
        UCS_ERR_NO_RESOURCE,
        UCS_ERR_IO_ERROR,
        UCS_ERR_NO_MEMORY,
        UCS_ERR_INVALID_PARAM,
        UCS_ERR_UNREACHABLE,
        UCS_ERR_INVALID_ADDR,
        UCS_ERR_NOT_IMPLEMENTED,
        UCS_ERR_MESSAGE_TRUNCATED,
        UCS_ERR_NO_PROGRESS,
        UCS_ERR_BUFFER_TOO_SMALL,
        UCS_ERR_NO_ELEM,
        UCS_ERR_SOME_CONNECTS_FAILED,
        UCS_ERR_NO_DEVICE,
        UCS_ERR_BUSY,
        UCS_ERR_CANCELED,
        UCS_ERR_SHMEM_SEGMENT,
        UCS_ERR_ALREADY_EXISTS,
        UCS_ERR_OUT_OF_RANGE,
        UCS_ERR_TIMED_OUT,
        UCS_ERR_EXCEEDS_LIMIT,
        UCS_ERR_UNSUPPORTED,
        UCS_ERR_REJECTED,
        UCS_ERR_NOT_CONNECTED,
        UCS_ERR_CONNECTION_RESET,
        UCS_ERR_FIRST_LINK_FAILURE,
        UCS_ERR_LAST_LINK_FAILURE,
        UCS_ERR_FIRST_ENDPOINT_FAILURE,
        UCS_ERR_ENDPOINT_TIMEOUT,
        UCS_ERR_LAST_ENDPOINT_FAILURE,
    ]
};

/// Bytes an operation sends, owned (type-erased) until UCX is done with them.
pub(crate) type Buffer = Box<dyn std::any::Any>;

/// Where a request's completion lands (shared by the callback and the
/// Request), and the buffers UCX may read until then.
pub(crate) struct Completion {
    pub(crate) status: Cell<Option<ucs_status_t>>,
    waker: RefCell<Option<Waker>>,
    buffer: RefCell<Option<Buffer>>,
}

unsafe extern "C" fn on_send_done(_request: *mut c_void, status: ucs_status_t, user_data: *mut c_void) {
    // SAFETY: user_data is an Rc<Completion> leaked for this callback in Request::param
    // and reclaimed here exactly once (UCX calls the callback once per request it
    // returned; for an immediate completion it does not call it, and from_status
    // reclaims that reference instead).
    let done = unsafe { Rc::from_raw(user_data.cast::<Completion>()) };
    done.status.set(Some(status));
    let buffer = done.buffer.borrow_mut().take();
    drop(buffer);
    let waker = done.waker.borrow_mut().take();
    if let Some(w) = waker {
        w.wake();
    }
}

/// An operation in flight. Await it (with the worker progressing, e.g. a
/// driver task calling [`Worker::progress`](crate::Worker::progress) on event-fd wake-ups), or
/// [`Request::wait`] for it. Dropping it early does not wait: the operation
/// goes on, its buffers stay owned until UCX is done, and the worker frees
/// it then.
pub struct Request {
    worker: Rc<WorkerInner>,
    req: raw::ucs_status_ptr_t,
    done: Rc<Completion>,
}

impl Request {
    pub(crate) fn param(buffer: Option<Buffer>) -> (raw::ucp_request_param_t, Rc<Completion>) {
        let done =
            Rc::new(Completion { status: Cell::new(None), waker: RefCell::new(None), buffer: RefCell::new(buffer) });
        let mut param = raw::ucp_request_param_t {
            op_attr_mask: raw::UCP_OP_ATTR_FIELD_CALLBACK | raw::UCP_OP_ATTR_FIELD_USER_DATA,
            user_data: Rc::into_raw(done.clone()).cast_mut().cast(),
            ..Default::default()
        };
        param.cb.send = Some(on_send_done);
        (param, done)
    }

    pub(crate) fn from_status(
        op: &'static str,
        worker: &Rc<WorkerInner>,
        ptr: raw::ucs_status_ptr_t,
        done: Rc<Completion>,
    ) -> Result<Self> {
        if !is_request(ptr) {
            // Completed (or failed) at once: UCX will not call the callback, so its
            // reference to the completion, and the buffers, are released here.
            // SAFETY: the pointer made by Rc::into_raw in param, reclaimed once.
            drop(unsafe { Rc::from_raw(Rc::as_ptr(&done)) });
            let buffer = done.buffer.borrow_mut().take();
            drop(buffer);
            check(op, ptr_status(ptr))?;
            done.status.set(Some(ucs_status_t::UCS_OK));
            return Ok(Self { worker: worker.clone(), req: std::ptr::null_mut(), done });
        }
        Ok(Self { worker: worker.clone(), req: ptr, done })
    }

    /// Done yet? `Some` once progress reported the operation complete.
    pub fn poll_done(&self) -> Option<Result<()>> {
        self.done.status.get().map(|s| check("request", s))
    }

    /// Progresses the worker until this request is done (a busy loop: for
    /// tests and shutdown, not the data path; a peer that must progress for
    /// it to finish has to be progressing elsewhere).
    pub fn wait(self) -> Result<()> {
        loop {
            if let Some(r) = self.poll_done() {
                return r;
            }
            self.worker.progress();
        }
    }
}

impl Future for Request {
    type Output = Result<()>;
    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        if let Some(r) = self.poll_done() {
            return Poll::Ready(r);
        }
        *self.done.waker.borrow_mut() = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if self.req.is_null() {
            return;
        }
        if self.done.status.get().is_none() {
            // Still in flight: the worker frees it once its callback ran.
            self.worker.orphans.borrow_mut().push((self.req, self.done.clone()));
            return;
        }
        // SAFETY: completed (callback ran); freed once.
        unsafe { raw::ucp_request_free(self.req) };
    }
}

impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request").field("done", &self.done.status.get()).finish()
    }
}
