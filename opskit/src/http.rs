//! An HTTP/1.1 client for tests, on hyper: one connection per request (no pool, so a
//! test never reuses a connection the server is closing), every exchange bounded by its
//! timeout, answers read whole ([`Response`]) or as server-sent events ([`EventStream`]).
//!
//! Addresses are `host:port`, as every tandem process prints them (`http://` is accepted
//! and ignored). [`blocking`] runs the same calls from plain threads, or from sync code
//! inside a runtime: each call runs on a thread of its own with its own current-thread
//! runtime, so it never nests runtimes.

use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper_util::rt::TokioIo;
use tokio::task::JoinHandle;

pub use hyper::HeaderMap;

pub use crate::sse::SseEvent;
use crate::sse::SseParser;
use crate::{Error, Result};

/// How long one exchange (or one event of a stream) may take by default: a real model on a
/// busy 2-core machine answers a long request in tens of seconds.
pub const TIMEOUT: Duration = Duration::from_secs(120);

/// How long a connect may take; loopback answers at once or refuses.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest server-sent event a stream takes (a longer one is an error, not memory).
const MAX_EVENT: usize = 16 << 20;

/// A whole answer.
#[derive(Debug, Clone)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The headers (names are case-insensitive).
    pub headers: HeaderMap,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

impl Response {
    /// The body as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON; the error quotes the body.
    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_slice(&self.body).map_err(|e| Error::Http(format!("not JSON ({e}): {}", self.text())))
    }

    /// Header `name`'s value, if present and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// A request to build and send.
#[derive(Debug, Clone)]
pub struct Request {
    addr: String,
    method: hyper::Method,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    timeout: Duration,
}

impl Request {
    /// `method` (`GET`, `POST`, ...) of `path` on `addr`; an unknown method is sent as written.
    pub fn new(method: &str, addr: &str, path: &str) -> Self {
        let method = hyper::Method::from_bytes(method.as_bytes()).unwrap_or(hyper::Method::GET);
        let addr = addr.trim_start_matches("http://").trim_end_matches('/').to_owned();
        Self { addr, method, path: path.to_owned(), headers: Vec::new(), body: Vec::new(), timeout: TIMEOUT }
    }

    pub fn get(addr: &str, path: &str) -> Self {
        Self::new("GET", addr, path)
    }

    pub fn post(addr: &str, path: &str) -> Self {
        Self::new("POST", addr, path)
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// A JSON body (`Content-Type: application/json`).
    pub fn json(self, body: &serde_json::Value) -> Self {
        self.body("application/json", body.to_string().into_bytes())
    }

    /// A body of `content_type` (none when empty).
    pub fn body(mut self, content_type: &str, body: impl Into<Vec<u8>>) -> Self {
        if !content_type.is_empty() {
            self.headers.push(("content-type".into(), content_type.to_owned()));
        }
        self.body = body.into();
        self
    }

    /// The bound on the exchange ([`Request::send`]) or on each event ([`Request::stream`]).
    pub fn timeout(mut self, limit: Duration) -> Self {
        self.timeout = limit;
        self
    }

    fn what(&self) -> String {
        format!("{} http://{}{}", self.method, self.addr, self.path)
    }

    /// Sends it and reads the whole answer.
    pub async fn send(self) -> Result<Response> {
        let (what, limit) = (self.what(), self.timeout);
        let exchange = async {
            let (head, body, _conn) = self.exchange().await?;
            let bytes = body.collect().await.map_err(|e| Error::Http(format!("{what}: reading the body: {e}")))?;
            Ok(Response { status: head.status.as_u16(), headers: head.headers, body: bytes.to_bytes().to_vec() })
        };
        tokio::time::timeout(limit, exchange)
            .await
            .map_err(|_| Error::Timeout(format!("{what} did not answer within {limit:?}")))?
    }

    /// Sends it and returns once the answer's head is read: the events are read with
    /// [`EventStream::next_event`]. Dropping the stream closes the connection (a client
    /// going away).
    pub async fn stream(self) -> Result<EventStream> {
        let (what, limit) = (self.what(), self.timeout);
        let (head, body, conn) = tokio::time::timeout(limit, self.exchange())
            .await
            .map_err(|_| Error::Timeout(format!("{what}: no answer head within {limit:?}")))??;
        Ok(EventStream {
            status: head.status.as_u16(),
            headers: head.headers,
            body,
            parser: SseParser::new(MAX_EVENT),
            ready: VecDeque::new(),
            ended: false,
            timeout: limit,
            what,
            _conn: conn,
        })
    }

    /// Starts sending it on a task of the current runtime and returns at once; the answer is
    /// read with [`InFlight::finish`]. Dropping the handle closes the connection: a client
    /// that gave up waiting. Panics outside a tokio runtime.
    pub fn start(self) -> InFlight {
        InFlight { task: tokio::spawn(self.send()) }
    }

    /// [`Request::send`] from sync code.
    pub fn send_blocking(self) -> Result<Response> {
        blocking::run(self.send())
    }

    /// Connects, sends, and reads the head; the connection lives until the returned
    /// [`Conn`] is dropped.
    async fn exchange(self) -> Result<(hyper::http::response::Parts, Incoming, Conn)> {
        let what = self.what();
        let tcp = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(&self.addr))
            .await
            .map_err(|_| Error::Timeout(format!("{what}: no connection within {CONNECT_TIMEOUT:?}")))?
            .map_err(|e| Error::Http(format!("{what}: connect: {e}")))?;
        let _ = tcp.set_nodelay(true);
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| Error::Http(format!("{what}: handshake: {e}")))?;
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = hyper::Request::builder().method(self.method).uri(&self.path).header("host", &self.addr);
        for (k, v) in &self.headers {
            req = req.header(k, v);
        }
        let req = req
            .body(Full::new(Bytes::from(self.body)))
            .map_err(|e| Error::Http(format!("{what}: building the request: {e}")))?;
        let resp = sender.send_request(req).await.map_err(|e| Error::Http(format!("{what}: {e}")))?;
        let (head, body) = resp.into_parts();
        Ok((head, body, Conn { task, _sender: sender }))
    }
}

/// One connection: its driver task (aborted on drop, which closes the socket) and the
/// sending half, kept so the connection is not wound down while an answer is read.
#[derive(Debug)]
struct Conn {
    task: JoinHandle<()>,
    _sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A request being sent on a task ([`Request::start`]).
#[derive(Debug)]
pub struct InFlight {
    task: JoinHandle<Result<Response>>,
}

impl InFlight {
    /// Waits for the whole answer.
    pub async fn finish(mut self) -> Result<Response> {
        (&mut self.task).await.map_err(|e| Error::Http(format!("the request's task ended: {e}")))?
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `GET path` on `addr`: the whole answer.
pub async fn get(addr: &str, path: &str) -> Result<Response> {
    Request::get(addr, path).send().await
}

/// `POST path` on `addr` with a JSON body: the whole answer.
pub async fn post_json(addr: &str, path: &str, body: &serde_json::Value) -> Result<Response> {
    Request::post(addr, path).json(body).send().await
}

/// `GET path` on `addr` within `limit`: the status code.
pub async fn status(addr: &str, path: &str, limit: Duration) -> Result<u16> {
    Ok(Request::get(addr, path).timeout(limit).send().await?.status)
}

/// A server-sent event stream being read as it arrives.
#[derive(Debug)]
pub struct EventStream {
    /// The answer's status code (a refusal has a JSON body instead of events: [`EventStream::text`]).
    pub status: u16,
    /// The answer's headers.
    pub headers: HeaderMap,
    body: Incoming,
    /// Bytes read but not yet whole events.
    parser: SseParser,
    /// Whole events not yet returned, oldest first.
    ready: VecDeque<SseEvent>,
    /// The answer has ended.
    ended: bool,
    timeout: Duration,
    what: String,
    _conn: Conn,
}

impl EventStream {
    /// The next event's data (its `data:` lines joined by newlines), or `None` at the end of
    /// the answer. Events with no data (comments, keep-alives) are skipped. Each event must
    /// come within the stream's timeout.
    pub async fn next_event(&mut self) -> Result<Option<String>> {
        Ok(self.next_sse().await?.map(|e| e.data))
    }

    /// The next whole event with its last event id ([`SseEvent`]), or `None` at the end.
    pub async fn next_sse(&mut self) -> Result<Option<SseEvent>> {
        loop {
            if let Some(e) = self.ready.pop_front() {
                return Ok(Some(e));
            }
            if self.ended {
                return Ok(None);
            }
            let bytes = match self.next_bytes().await? {
                Some(b) => b.to_vec(),
                None => {
                    // The end of the answer ends an event that had no blank line after it.
                    self.ended = true;
                    b"\n\n".to_vec()
                }
            };
            let mut events = Vec::new();
            self.parser.push(&bytes, &mut events).map_err(|e| Error::Http(format!("{}: {e}", self.what)))?;
            self.ready.extend(events);
        }
    }

    /// Reads to the end: every remaining event's data.
    pub async fn rest(mut self) -> Result<Vec<String>> {
        let mut out = Vec::new();
        while let Some(e) = self.next_event().await? {
            out.push(e);
        }
        Ok(out)
    }

    /// Reads to the end and returns the body as text (for an answer that is not a stream,
    /// read instead of its events).
    pub async fn text(mut self) -> Result<String> {
        let mut all = Vec::new();
        while let Some(b) = self.next_bytes().await? {
            all.extend_from_slice(&b);
        }
        Ok(String::from_utf8_lossy(&all).into_owned())
    }

    async fn next_bytes(&mut self) -> Result<Option<Bytes>> {
        loop {
            let frame = tokio::time::timeout(self.timeout, self.body.frame())
                .await
                .map_err(|_| Error::Timeout(format!("{}: nothing more within {:?}", self.what, self.timeout)))?;
            match frame {
                None => return Ok(None),
                Some(Err(e)) => return Err(Error::Http(format!("{}: reading the stream: {e}", self.what))),
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        return Ok(Some(data));
                    }
                }
            }
        }
    }
}

/// The same client for sync code.
pub mod blocking {
    use super::*;

    /// Runs `fut` to its end on a fresh thread with its own current-thread runtime, so it
    /// works from plain threads and from sync code inside a runtime alike.
    pub fn run<F>(fut: F) -> F::Output
    where
        F: Future + Send,
        F::Output: Send,
    {
        std::thread::scope(|s| {
            s.spawn(|| {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
                match rt {
                    Ok(rt) => Ok(rt.block_on(fut)),
                    Err(e) => Err(e),
                }
            })
            .join()
        })
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
        .unwrap_or_else(|e| panic!("building a current-thread runtime: {e}"))
    }

    /// [`super::get`] from sync code.
    pub fn get(addr: &str, path: &str) -> Result<Response> {
        Request::get(addr, path).send_blocking()
    }

    /// [`super::post_json`] from sync code.
    pub fn post_json(addr: &str, path: &str, body: &serde_json::Value) -> Result<Response> {
        Request::post(addr, path).json(body).send_blocking()
    }

    /// [`super::status`] from sync code.
    pub fn status(addr: &str, path: &str, limit: Duration) -> Result<u16> {
        run(super::status(addr, path, limit))
    }

    /// A server-sent event stream read from sync code ([`super::EventStream`]); dropping it
    /// closes the connection.
    #[derive(Debug)]
    pub struct EventStream {
        /// The answer's status code.
        pub status: u16,
        /// The answer's headers.
        pub headers: HeaderMap,
        /// Its runtime (the connection's driver is a task on it) and the stream.
        inner: Option<(tokio::runtime::Runtime, super::EventStream)>,
    }

    impl Request {
        /// [`Request::stream`] from sync code.
        pub fn stream_blocking(self) -> Result<EventStream> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| Error::io("building a current-thread runtime", e))?;
            let stream = on_own_thread(&rt, self.stream())?;
            Ok(EventStream { status: stream.status, headers: stream.headers.clone(), inner: Some((rt, stream)) })
        }
    }

    /// Drives `fut` on `rt` from a fresh thread (outside any runtime of the caller's).
    fn on_own_thread<F>(rt: &tokio::runtime::Runtime, fut: F) -> F::Output
    where
        F: Future + Send,
        F::Output: Send,
    {
        std::thread::scope(|s| s.spawn(|| rt.block_on(fut)).join()).unwrap_or_else(|p| std::panic::resume_unwind(p))
    }

    impl EventStream {
        /// [`super::EventStream::next_event`].
        pub fn next_event(&mut self) -> Result<Option<String>> {
            let Some((rt, stream)) = self.inner.as_mut() else { return Ok(None) };
            on_own_thread(rt, stream.next_event())
        }

        /// [`super::EventStream::next_sse`].
        pub fn next_sse(&mut self) -> Result<Option<SseEvent>> {
            let Some((rt, stream)) = self.inner.as_mut() else { return Ok(None) };
            on_own_thread(rt, stream.next_sse())
        }

        /// [`super::EventStream::rest`].
        pub fn rest(mut self) -> Result<Vec<String>> {
            let mut out = Vec::new();
            while let Some(e) = self.next_event()? {
                out.push(e);
            }
            Ok(out)
        }

        /// [`super::EventStream::text`].
        pub fn text(mut self) -> Result<String> {
            let Some((rt, stream)) = self.inner.take() else { return Ok(String::new()) };
            let text = on_own_thread(&rt, stream.text());
            drop_outside(rt);
            text
        }
    }

    impl Drop for EventStream {
        fn drop(&mut self) {
            if let Some((rt, stream)) = self.inner.take() {
                drop(stream);
                drop_outside(rt);
            }
        }
    }

    /// Drops a runtime on a fresh thread: dropping one inside another runtime panics.
    fn drop_outside(rt: tokio::runtime::Runtime) {
        std::thread::scope(|s| {
            s.spawn(move || drop(rt));
        });
    }
}

#[cfg(test)]
mod tests;
