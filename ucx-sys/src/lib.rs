//! UCX's `ucp` API for tandem's one-sided KV transport.
//!
//! [`raw`] is the bindgen binding of Debian's `libucx-dev` (1.13). The rest
//! of this crate is the safe wrapper, and the only place in the project that
//! calls into it: every `unsafe` block says why it is sound.
//!
//! The model is UCX's own, in single-thread mode: one [`Context`] per process
//! (transports and memory registrations), one [`Worker`] per thread that
//! drives progress, [`Endpoint`]s to peers' workers, [`Region`]s of
//! registered memory whose packed key lets a peer write into them with
//! [`Endpoint::put`], and small active messages ([`Endpoint::send_am`],
//! [`Worker::on_am`]) for control. All of these are `!Send`: they live on the
//! thread that created them, which must also be the one calling
//! [`Worker::progress`]. Operations return a [`Request`], a future that
//! completes when progress reports the operation done; dropping an unfinished
//! one cancels it and progresses until UCX no longer touches its buffers.
//!
//! Transports are chosen by UCX's environment (`UCX_TLS`, `UCX_NET_DEVICES`):
//! shared memory, CMA and TCP on a plain host, RDMA verbs (rc, dc) where a
//! NIC has them. The same calls run over all of them.

#![allow(clippy::missing_safety_doc)]

use std::cell::{Cell, RefCell};
use std::ffi::{c_void, CStr, CString};
use std::marker::PhantomData;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::rc::Rc;

#[allow(non_camel_case_types, non_upper_case_globals, non_snake_case, dead_code, clippy::all)]
pub mod raw {
    include!(concat!(env!("OUT_DIR"), "/ucp.rs"));
}

use raw::ucs_status_t;

mod region;
mod request;

pub use region::{OutOfRange, Region};
pub use request::Request;
use request::{is_request, Buffer, Completion};

/// A UCX call that failed: which call, and UCX's status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{op}: {}", status_text(*.status))]
pub struct Error {
    pub op: &'static str,
    pub status: ucs_status_t,
}

impl Error {
    fn new(op: &'static str, status: ucs_status_t) -> Self {
        Self { op, status }
    }

    /// The peer is gone or unreachable (as opposed to a local misuse or a
    /// resource limit): what a transport reports as a link failure.
    pub fn is_peer_failure(&self) -> bool {
        use ucs_status_t::*;
        matches!(
            self.status,
            UCS_ERR_UNREACHABLE
                | UCS_ERR_CONNECTION_RESET
                | UCS_ERR_ENDPOINT_TIMEOUT
                | UCS_ERR_REJECTED
                | UCS_ERR_IO_ERROR
                | UCS_ERR_CANCELED
                | UCS_ERR_NOT_CONNECTED
        ) || (self.status as i32) <= ucs_status_t::UCS_ERR_FIRST_LINK_FAILURE as i32
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// UCX's own text for a status.
pub fn status_text(status: ucs_status_t) -> String {
    // SAFETY: ucs_status_string accepts any status value and returns a pointer
    // to a static NUL-terminated string (or "Unknown error" text), never null.
    let p = unsafe { raw::ucs_status_string(status) };
    if p.is_null() {
        return format!("status {}", status as i32);
    }
    // SAFETY: non-null, static, NUL-terminated (above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn check(op: &'static str, status: ucs_status_t) -> Result<()> {
    match status {
        ucs_status_t::UCS_OK => Ok(()),
        s => Err(Error::new(op, s)),
    }
}

/// The UCX library version, e.g. "1.13.1".
pub fn version() -> String {
    // SAFETY: returns a static NUL-terminated string.
    let p = unsafe { raw::ucp_get_version_string() };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: as above.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A UCP context: the transports UCX found and the memory it registers.
/// Configured from the environment (`UCX_*`), like every UCX program.
pub struct Context {
    h: raw::ucp_context_h,
    _not_send: PhantomData<*const ()>,
}

impl Context {
    /// A context with remote memory access, active messages and wake-up on
    /// an event fd.
    pub fn new(name: &str) -> Result<Rc<Self>> {
        let name = CString::new(name.replace('\0', "")).unwrap_or_default();
        let mut config: *mut raw::ucp_config_t = std::ptr::null_mut();
        // SAFETY: null prefix and file mean "UCX_ env vars, no file"; config is an out pointer.
        check("ucp_config_read", unsafe { raw::ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config) })?;
        let params = raw::ucp_params_t {
            field_mask: (raw::UCP_PARAM_FIELD_FEATURES | raw::UCP_PARAM_FIELD_NAME) as u64,
            features: (raw::UCP_FEATURE_RMA | raw::UCP_FEATURE_AM | raw::UCP_FEATURE_WAKEUP) as u64,
            name: name.as_ptr(),
            ..Default::default()
        };
        let mut h: raw::ucp_context_h = std::ptr::null_mut();
        // SAFETY: params and config are valid for the call (name outlives it); h is an out
        // pointer. ucp_init is an inline wrapper of ucp_init_version with these constants.
        let status = unsafe { raw::ucp_init_version(raw::UCP_API_MAJOR, raw::UCP_API_MINOR, &params, config, &mut h) };
        // SAFETY: config came from ucp_config_read and is released exactly once.
        unsafe { raw::ucp_config_release(config) };
        check("ucp_init", status)?;
        Ok(Rc::new(Self { h, _not_send: PhantomData }))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every worker and region holds an Rc of this context, so none is alive.
        unsafe { raw::ucp_cleanup(self.h) };
    }
}

type AmHandler = Box<dyn FnMut(AmMessage<'_>)>;

/// An active message as delivered: valid only during the handler call.
pub struct AmMessage<'a> {
    pub header: &'a [u8],
    /// `None` when the sender used the rendezvous protocol, which this wrapper
    /// does not accept (control messages are small and sent eager).
    pub data: Option<&'a [u8]>,
}

struct WorkerInner {
    /// Kept alive while the worker is: destroyed after it.
    _ctx: Rc<Context>,
    h: raw::ucp_worker_h,
    handlers: RefCell<Vec<(u16, *mut AmHandler)>>,
    /// Requests whose [`Request`] was dropped before they completed: freed by
    /// [`Worker::progress`] once their callback ran (UCX may still be reading
    /// their buffers until then; the buffers live in the completion).
    orphans: RefCell<Vec<(raw::ucs_status_ptr_t, Rc<Completion>)>>,
    /// The failure cells of closed endpoints (their error handler's
    /// argument), freed once the worker is destroyed: UCX 1.13 may still call
    /// an endpoint's error handler after its forced close completed, from a
    /// failure it had already queued (over tcp, in-process tests caught it
    /// writing a freed cell: glibc's "unaligned tcache chunk detected"
    /// aborts). One small allocation per endpoint the worker ever closed.
    closed_eps: RefCell<Vec<*mut Cell<Option<ucs_status_t>>>>,
}

impl WorkerInner {
    fn progress(&self) -> u32 {
        // SAFETY: worker alive, and used only from its own thread (the types are !Send).
        let n = unsafe { raw::ucp_worker_progress(self.h) };
        self.orphans.borrow_mut().retain(|(req, done)| {
            if done.status.get().is_none() {
                return true;
            }
            // SAFETY: completed (its callback ran), never freed before, freed once.
            unsafe { raw::ucp_request_free(*req) };
            false
        });
        n
    }
}

/// How long a worker's destruction progresses it first (see its `Drop`).
/// Measured with `UCX_TLS=tcp` on kvtransfer's
/// `dead_peers_give_typed_errors_in_bounded_time_and_leak_nothing`, which
/// shuts a server down just after a sender connected: 3 of 64 runs aborted
/// without it, 0 of 64 with it.
const WIREUP_DRAIN: std::time::Duration = std::time::Duration::from_millis(100);

impl Drop for WorkerInner {
    #[allow(clippy::disallowed_types, reason = "a bounded wall-clock drain on the worker's own thread")]
    fn drop(&mut self) {
        // Endpoints hold an Rc of this worker, so all are closed (forced), which completed
        // every operation on them: orphans are done, and freed here.
        for (req, _) in self.orphans.borrow_mut().drain(..) {
            // SAFETY: a request of this worker, not yet freed.
            unsafe { raw::ucp_request_free(req) };
        }
        // Progress a little before destroying: UCX 1.13 (Debian's) asserts, aborting the
        // process, when destroying a worker purges a wire-up reply still queued on a tcp
        // endpoint whose connection is being set up (a peer that connected just before;
        // upstream dropped the assertion in openucx/ucx#8175). Progress lets the reply go
        // out. Bounded, and idle rounds sleep instead of spinning.
        let deadline = std::time::Instant::now() + WIREUP_DRAIN;
        while std::time::Instant::now() < deadline {
            // SAFETY: the worker is alive until the destroy below; handlers' boxes are too.
            if unsafe { raw::ucp_worker_progress(self.h) } == 0 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        // SAFETY: endpoints, keys and requests hold an Rc of this worker, so none is alive;
        // after destroy no handler can run, so their boxes are freed after it.
        unsafe { raw::ucp_worker_destroy(self.h) };
        for (_, p) in self.handlers.borrow_mut().drain(..) {
            // SAFETY: p came from Box::into_raw in on_am and is freed once.
            drop(unsafe { Box::from_raw(p) });
        }
        for p in self.closed_eps.borrow_mut().drain(..) {
            // SAFETY: p came from Box::into_raw in connect_with, was handed here once by
            // its closed endpoint, and no error handler can run after the destroy above.
            drop(unsafe { Box::from_raw(p) });
        }
    }
}

/// A worker's event fd, for a reactor; holds the worker alive (see
/// [`Worker::async_event_fd`]).
pub struct EventFd {
    fd: RawFd,
    _worker: Rc<WorkerInner>,
}

impl std::os::fd::AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

/// What an endpoint does when its peer dies or becomes unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerFailure {
    /// UCX's peer error-handling mode: requests fail instead of hanging and
    /// [`Endpoint::failure`] reports it. UCX then uses only transports that
    /// can detect a dead peer: in UCX 1.13 that excludes the shared-memory
    /// ones (sysv, posix) and CMA, leaving TCP (or verbs) even between two
    /// processes of one host.
    Reported,
    /// No error handling: UCX may use every transport (shared memory and CMA
    /// on one host), but an operation to a dead peer may never complete.
    /// Bound every wait on such an endpoint, and learn of the peer's death
    /// from a [`PeerFailure::Reported`] endpoint to the same worker.
    Unreported,
}

/// A UCP worker: the progress engine, owned by one thread.
#[derive(Clone)]
pub struct Worker {
    inner: Rc<WorkerInner>,
}

impl Worker {
    pub fn new(ctx: &Rc<Context>) -> Result<Self> {
        let params = raw::ucp_worker_params_t {
            field_mask: raw::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: raw::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut h: raw::ucp_worker_h = std::ptr::null_mut();
        // SAFETY: context alive; params valid; h is an out pointer.
        check("ucp_worker_create", unsafe { raw::ucp_worker_create(ctx.h, &params, &mut h) })?;
        Ok(Self {
            inner: Rc::new(WorkerInner {
                _ctx: ctx.clone(),
                h,
                handlers: RefCell::new(Vec::new()),
                orphans: RefCell::new(Vec::new()),
                closed_eps: RefCell::new(Vec::new()),
            }),
        })
    }

    /// This worker's address, for a peer's [`Worker::connect`].
    pub fn address(&self) -> Result<Vec<u8>> {
        let mut addr: *mut raw::ucp_address_t = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: worker alive; out pointers.
        check("ucp_worker_get_address", unsafe { raw::ucp_worker_get_address(self.inner.h, &mut addr, &mut len) })?;
        // SAFETY: UCX returned len readable bytes; copied, then released once.
        let out = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) }.to_vec();
        // SAFETY: addr came from ucp_worker_get_address on this worker.
        unsafe { raw::ucp_worker_release_address(self.inner.h, addr) };
        Ok(out)
    }

    /// Runs pending communication; returns how many events it handled.
    /// Completion callbacks and active-message handlers run inside it.
    pub fn progress(&self) -> u32 {
        self.inner.progress()
    }

    /// The fd that becomes readable when there is work for [`Worker::progress`]
    /// (after a successful [`Worker::arm`]).
    pub fn event_fd(&self) -> Result<RawFd> {
        let mut fd: i32 = -1;
        // SAFETY: worker alive (created with the WAKEUP feature); fd is an out pointer.
        check("ucp_worker_get_efd", unsafe { raw::ucp_worker_get_efd(self.inner.h, &mut fd) })?;
        Ok(fd)
    }

    /// The event fd in the current tokio runtime's reactor (call it inside
    /// one): readable when there is work for [`Worker::progress`] after a
    /// successful [`Worker::arm`]. The [`EventFd`] keeps this worker, which
    /// owns the descriptor, alive while it is registered.
    pub fn async_event_fd(&self) -> std::io::Result<tokio::io::unix::AsyncFd<EventFd>> {
        let fd = self.event_fd().map_err(|e| std::io::Error::other(e.to_string()))?;
        let efd = EventFd { fd, _worker: self.inner.clone() };
        // SAFETY: the descriptor is the UCX worker's and stays open until
        // ucp_worker_destroy, which runs only when the last Rc of the worker
        // goes; the EventFd inside the AsyncFd holds one, so the fd is open and
        // unreplaced for as long as the reactor has it registered.
        unsafe { tokio::io::unix::AsyncFd::register(efd) }.map_err(std::io::Error::from)
    }

    /// Arms the event fd. `Ok(false)`: events are already pending, call
    /// [`Worker::progress`] again instead of waiting.
    pub fn arm(&self) -> Result<bool> {
        // SAFETY: worker alive.
        match unsafe { raw::ucp_worker_arm(self.inner.h) } {
            ucs_status_t::UCS_OK => Ok(true),
            ucs_status_t::UCS_ERR_BUSY => Ok(false),
            s => Err(Error::new("ucp_worker_arm", s)),
        }
    }

    /// An endpoint to the worker at `address` (from its [`Worker::address`]),
    /// in peer error-handling mode: a dead peer fails its requests instead of
    /// hanging them, and [`Endpoint::failure`] reports it.
    pub fn connect(&self, address: &[u8]) -> Result<Endpoint> {
        self.connect_with(address, PeerFailure::Reported)
    }

    /// An endpoint to the worker at `address` with the given handling of a
    /// peer's failure (see [`PeerFailure`]).
    pub fn connect_with(&self, address: &[u8], peer_failure: PeerFailure) -> Result<Endpoint> {
        let failed = Box::into_raw(Box::new(Cell::new(None::<ucs_status_t>)));
        let err_mode = match peer_failure {
            PeerFailure::Reported => raw::UCP_ERR_HANDLING_MODE_PEER,
            PeerFailure::Unreported => raw::UCP_ERR_HANDLING_MODE_NONE,
        };
        let params = raw::ucp_ep_params_t {
            field_mask: (raw::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | raw::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | raw::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
            address: address.as_ptr().cast(),
            err_mode,
            err_handler: raw::ucp_err_handler_t { cb: Some(on_ep_error), arg: failed.cast() },
            ..Default::default()
        };
        let mut h: raw::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: worker alive; the address bytes outlive the call (UCX copies what it
        // needs); `failed` stays allocated until the worker is destroyed (EpInner::drop
        // hands it to the worker).
        let status = unsafe { raw::ucp_ep_create(self.inner.h, &params, &mut h) };
        if let Err(e) = check("ucp_ep_create", status) {
            // SAFETY: no endpoint holds the pointer; freed once.
            drop(unsafe { Box::from_raw(failed) });
            return Err(e);
        }
        Ok(Endpoint { inner: Rc::new(EpInner { worker: self.inner.clone(), h, failed }) })
    }

    /// Calls `handler` for every active message with `id` that arrives, from
    /// inside [`Worker::progress`]. One handler per id; a second call replaces it.
    pub fn on_am(&self, id: u16, handler: impl FnMut(AmMessage<'_>) + 'static) -> Result<()> {
        let boxed: *mut AmHandler = Box::into_raw(Box::new(Box::new(handler) as AmHandler));
        let params = raw::ucp_am_handler_param_t {
            field_mask: (raw::UCP_AM_HANDLER_PARAM_FIELD_ID
                | raw::UCP_AM_HANDLER_PARAM_FIELD_CB
                | raw::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64,
            id: u32::from(id),
            cb: Some(on_am_message),
            arg: boxed.cast(),
            ..Default::default()
        };
        // SAFETY: worker alive; `boxed` stays allocated while the worker lives (freed in
        // WorkerInner::drop, after ucp_worker_destroy).
        let status = unsafe { raw::ucp_worker_set_am_recv_handler(self.inner.h, &params) };
        if let Err(e) = check("ucp_worker_set_am_recv_handler", status) {
            // SAFETY: UCX did not take the pointer.
            drop(unsafe { Box::from_raw(boxed) });
            return Err(e);
        }
        // A replaced handler is kept until the worker is destroyed: a handler may be
        // replaced from inside another handler (during progress), so freeing it here
        // could free a closure that is running.
        self.inner.handlers.borrow_mut().push((id, boxed));
        Ok(())
    }

    /// Completes every operation this worker started, on every endpoint.
    pub fn flush(&self) -> Result<Request> {
        let (param, done) = Request::param(None);
        // SAFETY: worker alive; param valid for the call; the completion's Rc is
        // released by the callback or by Request (see Request::from_status).
        let ptr = unsafe { raw::ucp_worker_flush_nbx(self.inner.h, &param) };
        Request::from_status("ucp_worker_flush_nbx", &self.inner, ptr, done)
    }
}

unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: raw::ucp_ep_h, status: ucs_status_t) {
    // SAFETY: arg is the endpoint's `failed` cell, alive until the worker is destroyed
    // (even after the endpoint closed), and this runs on the worker's thread inside
    // progress.
    let failed = unsafe { &*arg.cast::<Cell<Option<ucs_status_t>>>() };
    failed.set(Some(status));
}

unsafe extern "C" fn on_am_message(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const raw::ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: arg is the boxed handler registered in on_am, alive while registered;
    // this runs on the worker's thread inside progress, never reentrantly for one worker.
    let handler = unsafe { &mut *arg.cast::<AmHandler>() };
    // SAFETY: UCX passes header_length readable bytes at header (or 0 and maybe null).
    let header = if header_length == 0 || header.is_null() {
        &[][..]
    } else {
        unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) }
    };
    // SAFETY: param is valid for the call.
    let rndv = !param.is_null() && unsafe { (*param).recv_attr } & raw::UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0;
    let data = if rndv {
        None
    } else if length == 0 || data.is_null() {
        Some(&[][..])
    } else {
        // SAFETY: eager data: `length` readable bytes valid for this call.
        Some(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) })
    };
    handler(AmMessage { header, data });
    // UCS_OK: we did not keep the data (UCX may reuse it at once).
    ucs_status_t::UCS_OK
}

struct EpInner {
    worker: Rc<WorkerInner>,
    h: raw::ucp_ep_h,
    failed: *mut Cell<Option<ucs_status_t>>,
}

impl Drop for EpInner {
    fn drop(&mut self) {
        let param = raw::ucp_request_param_t {
            op_attr_mask: raw::UCP_OP_ATTR_FIELD_FLAGS,
            flags: raw::UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: ep alive, closed once. Forced close: does not wait for the peer, and
        // fails (completes) every outstanding operation on it.
        let req = unsafe { raw::ucp_ep_close_nbx(self.h, &param) };
        if is_request(req) {
            // SAFETY: req is a live request of this worker: progress until UCX reports it
            // done, then free it. A forced close completes without the peer.
            while unsafe { raw::ucp_request_check_status(req) } == ucs_status_t::UCS_INPROGRESS {
                unsafe { raw::ucp_worker_progress(self.worker.h) };
            }
            unsafe { raw::ucp_request_free(req) };
        }
        // UCX may still call the error handler with this cell: the worker frees it
        // once destroyed.
        self.worker.closed_eps.borrow_mut().push(self.failed);
    }
}

/// A connection to a peer's worker.
#[derive(Clone)]
pub struct Endpoint {
    inner: Rc<EpInner>,
}

impl Endpoint {
    /// The error UCX reported for this endpoint (the peer died or became
    /// unreachable), if any. Every later operation on it fails.
    pub fn failure(&self) -> Option<Error> {
        // SAFETY: the cell lives as long as the endpoint; same thread.
        unsafe { &*self.inner.failed }.get().map(|s| Error::new("endpoint", s))
    }

    /// The transports UCX chose for this endpoint's lanes, as UCX names them
    /// (`"tcp/lo"`, `"sysv/memory"`, `"cma/memory"`, `"rc_mlx5/mlx5_0:1"`),
    /// in lane order without repeats: what `UCX_TLS` and the endpoint's
    /// error-handling mode left. Parsed from `ucp_ep_print_info` (UCX has no
    /// structured query for it in 1.13); empty if that output changes shape.
    pub fn transports(&self) -> Vec<String> {
        extern "C" {
            fn open_memstream(ptr: *mut *mut std::os::raw::c_char, size: *mut usize) -> *mut raw::FILE;
            fn fclose(f: *mut raw::FILE) -> i32;
            fn free(p: *mut c_void);
        }
        let (mut buf, mut len) = (std::ptr::null_mut(), 0usize);
        // SAFETY: glibc's open_memstream with valid out pointers; the stream is closed
        // once, after which buf holds len bytes (NUL-terminated) that we free once.
        let text = unsafe {
            let f = open_memstream(&mut buf, &mut len);
            if f.is_null() {
                return Vec::new();
            }
            raw::ucp_ep_print_info(self.inner.h, f);
            fclose(f);
            if buf.is_null() {
                return Vec::new();
            }
            let text = String::from_utf8_lossy(std::slice::from_raw_parts(buf.cast::<u8>(), len)).into_owned();
            free(buf.cast());
            text
        };
        lane_transports(&text)
    }

    /// A peer region's key, from its [`Region::pack_key`].
    pub fn unpack_key(&self, packed: &[u8]) -> Result<RemoteKey> {
        if packed.is_empty() {
            return Err(Error::new("ucp_ep_rkey_unpack", ucs_status_t::UCS_ERR_INVALID_PARAM));
        }
        let mut h: raw::ucp_rkey_h = std::ptr::null_mut();
        // SAFETY: ep alive; packed bytes valid for the call; h is an out pointer. UCX
        // parses the buffer it is given; a malformed key is an error status.
        check("ucp_ep_rkey_unpack", unsafe { raw::ucp_ep_rkey_unpack(self.inner.h, packed.as_ptr().cast(), &mut h) })?;
        Ok(RemoteKey { h, _ep: self.inner.clone() })
    }

    /// Writes `src` into the peer's memory at `remote_addr` (inside the region
    /// `key` was packed from). The request completes when UCX no longer needs
    /// `src` (it is dropped then); the bytes are at the peer after a later
    /// [`Endpoint::flush`] completes.
    pub fn put(&self, src: impl AsRef<[u8]> + 'static, remote_addr: u64, key: &RemoteKey) -> Result<Request> {
        if !Rc::ptr_eq(&key._ep, &self.inner) {
            return Err(Error::new("ucp_put_nbx", ucs_status_t::UCS_ERR_INVALID_PARAM));
        }
        let src = Box::new(src);
        let (ptr_src, len) = ((*src).as_ref().as_ptr(), (*src).as_ref().len());
        let (param, done) = Request::param(Some(src as Buffer));
        // SAFETY: ep and rkey alive (the key belongs to this endpoint, checked). The
        // source bytes are owned by the completion (boxed: moving the box does not move
        // them), which lives until UCX called back or completed at once.
        let ptr = unsafe { raw::ucp_put_nbx(self.inner.h, ptr_src.cast(), len, remote_addr, key.h, &param) };
        Request::from_status("ucp_put_nbx", &self.inner.worker, ptr, done)
    }

    /// Sends a small active message (eager protocol) to the peer's handler for
    /// `id`; `message` is the header (first `header_len` bytes) and the data.
    pub fn send_am(&self, id: u16, header: Vec<u8>, data: Vec<u8>) -> Result<Request> {
        let (hp, hl, dp, dl) = (header.as_ptr(), header.len(), data.as_ptr(), data.len());
        let (mut param, done) = Request::param(Some(Box::new((header, data))));
        param.op_attr_mask |= raw::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = raw::UCP_AM_SEND_FLAG_EAGER;
        // SAFETY: ep alive; header and data are owned by the completion (their heap
        // storage does not move with the tuple) until UCX is done with them.
        let ptr = unsafe { raw::ucp_am_send_nbx(self.inner.h, u32::from(id), hp.cast(), hl, dp.cast(), dl, &param) };
        Request::from_status("ucp_am_send_nbx", &self.inner.worker, ptr, done)
    }

    /// Completes (at the peer) every operation this endpoint started.
    pub fn flush(&self) -> Result<Request> {
        let (param, done) = Request::param(None);
        // SAFETY: ep alive; param valid for the call.
        let ptr = unsafe { raw::ucp_ep_flush_nbx(self.inner.h, &param) };
        Request::from_status("ucp_ep_flush_nbx", &self.inner.worker, ptr, done)
    }
}

/// `tcp/lo` from a lane line of `ucp_ep_print_info`, e.g.
/// `#                 lane[0]:  1:tcp/lo.0 md[1]  -> md[1]/tcp/sysdev[255] am am_bw#0`
/// (the resource after `N:`, without the `.0` path index), each once, in lane order.
fn lane_transports(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.split_once("lane[").and_then(|(_, r)| r.split_once("]:")).map(|(_, r)| r) else {
            continue;
        };
        let Some(resource) = rest.split_whitespace().next().and_then(|t| t.split_once(':')).map(|(_, r)| r) else {
            continue;
        };
        let name = resource.rsplit_once('.').map_or(resource, |(n, _)| n).to_owned();
        if !out.contains(&name) {
            out.push(name);
        }
    }
    out
}

/// An unpacked remote key, usable with the endpoint it was unpacked on.
pub struct RemoteKey {
    h: raw::ucp_rkey_h,
    _ep: Rc<EpInner>,
}

impl RemoteKey {
    /// Where the peer's bytes `remote_addr..remote_addr + len` (inside the
    /// region the key was packed from) are mapped into this process, when
    /// UCX reaches the peer through shared memory (its posix and sysv
    /// transports; `ucp_rkey_ptr`). `None` where it does not (tcp, CMA,
    /// RDMA: puts only), for an empty range, and for one UCX does not map
    /// as one contiguous piece. UCX answers for the whole segment behind
    /// the region, which may run past the region's end: the caller keeps to
    /// the bytes the peer gave it. The pointer stays valid while this key
    /// lives. Storing through it writes the peer's memory as a put over
    /// those transports does (UCX's put there is a copy into the same
    /// mapping); nothing orders such stores but the caller's own fences.
    pub fn mapped(&self, remote_addr: u64, len: usize) -> Option<NonNull<u8>> {
        let last = remote_addr.checked_add(u64::try_from(len).ok()?.checked_sub(1)?)?;
        let first = self.local(remote_addr)?;
        let end = self.local(last)?;
        (end.as_ptr() as usize).checked_sub(first.as_ptr() as usize).filter(|d| *d == len - 1).map(|_| first)
    }

    fn local(&self, remote_addr: u64) -> Option<NonNull<u8>> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: the key is alive (self); p is an out pointer. UCX checks the address
        // against the key's region and answers with a status.
        let status = unsafe { raw::ucp_rkey_ptr(self.h, remote_addr, &mut p) };
        if status == ucs_status_t::UCS_OK {
            NonNull::new(p.cast())
        } else {
            None
        }
    }
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        // SAFETY: rkey ours, destroyed once, before its endpoint (we hold it).
        unsafe { raw::ucp_rkey_destroy(self.h) };
    }
}

#[cfg(test)]
mod tests;
