//! The client against a loopback server that writes answers byte for byte, so framing
//! (chunks, events split across writes, CRLF) is what the test says it is.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::mpsc;

use super::*;

/// A server for one connection: reads the request head (and a body of `Content-Length`),
/// reports it, then writes `parts` one write each; then waits for the client to close.
fn server(parts: Vec<&'static [u8]>) -> (SocketAddr, mpsc::Receiver<String>, mpsc::Receiver<()>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let (req_tx, req_rx) = mpsc::channel();
    let (closed_tx, closed_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let Ok((mut c, _)) = l.accept() else { return };
        let mut got = Vec::new();
        let mut b = [0u8; 4096];
        loop {
            let Ok(n) = c.read(&mut b) else { return };
            got.extend_from_slice(&b[..n]);
            let text = String::from_utf8_lossy(&got).into_owned();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let len = head
                    .lines()
                    .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_owned()))
                    .and_then(|v| v.parse::<usize>().ok())
                    .unwrap_or(0);
                if body.len() >= len {
                    let _ = req_tx.send(text);
                    break;
                }
            }
            if n == 0 {
                return;
            }
        }
        for p in parts {
            if c.write_all(p).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // Until the client closes: EOF or a reset.
        while matches!(c.read(&mut b), Ok(n) if n > 0) {}
        let _ = closed_tx.send(());
    });
    (addr, req_rx, closed_rx)
}

#[tokio::test]
async fn a_json_post_sends_its_body_and_reads_a_chunked_answer() {
    let (addr, req, _) = server(vec![
        b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"7\r\n{\"a\": 1\r\n",
        b"1\r\n}\r\n0\r\n\r\n",
    ]);
    let r = Request::post(&addr.to_string(), "/v1/x")
        .header("x-api-key", "k1")
        .json(&serde_json::json!({"q": "hi"}))
        .send()
        .await
        .expect("answer");
    assert_eq!((r.status, r.header("retry-after")), (429, Some("3")));
    assert_eq!(r.json().expect("json")["a"], 1);
    let sent = req.recv_timeout(Duration::from_secs(5)).expect("request seen").to_ascii_lowercase();
    assert!(sent.starts_with("post /v1/x http/1.1\r\n"), "{sent}");
    assert!(sent.contains("x-api-key: k1") && sent.contains("content-type: application/json"), "{sent}");
    assert!(sent.ends_with("{\"q\":\"hi\"}"), "{sent}");
}

#[tokio::test]
async fn events_are_split_at_blank_lines_whatever_the_writes() {
    let (addr, _, _) = server(vec![
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
        // One event across two chunks, CRLF line ends, a comment, a two-line event.
        b"9\r\ndata: {\"a\r\n",
        b"8\r\n\":1}\r\n\r\n\r\n",
        b"e\r\n: keep-alive\n\n\r\n",
        b"14\r\ndata:one\ndata: two\n\n\r\n",
        b"d\r\ndata: [DONE]\n\r\n",
        b"0\r\n\r\n",
    ]);
    let mut s = Request::post(&addr.to_string(), "/s").stream().await.expect("head");
    assert_eq!(s.status, 200);
    assert_eq!(s.next_event().await.expect("event").as_deref(), Some("{\"a\":1}"));
    assert_eq!(s.next_event().await.expect("event").as_deref(), Some("one\ntwo"));
    // The last event had no blank line after it: the end of the answer ends it.
    assert_eq!(s.rest().await.expect("rest"), vec!["[DONE]".to_owned()]);
}

/// A character split across chunks, in a chunk that also ends an earlier event: the
/// earlier event is returned at once and the character is whole in the next.
#[tokio::test]
async fn a_character_split_across_chunks_arrives_whole() {
    let (addr, _, _) = server(vec![
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
        // "data: 1\n\ndata: " + the first two bytes of U+1F600.
        b"11\r\ndata: 1\n\ndata: \xf0\x9f\r\n",
        b"4\r\n\x98\x80\n\n\r\n",
        b"0\r\n\r\n",
    ]);
    let mut s = Request::get(&addr.to_string(), "/s").stream().await.expect("head");
    assert_eq!(s.next_event().await.expect("event").as_deref(), Some("1"));
    assert_eq!(s.next_event().await.expect("event").as_deref(), Some("\u{1f600}"));
    assert_eq!(s.next_event().await.expect("end"), None);
}

#[tokio::test]
async fn dropping_a_stream_closes_the_connection() {
    let (addr, _, closed) =
        server(vec![b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"9\r\ndata: 1\n\n\r\n"]);
    let mut s = Request::get(&addr.to_string(), "/s").stream().await.expect("head");
    assert_eq!(s.next_event().await.expect("event").as_deref(), Some("1"));
    drop(s);
    assert!(seen_closed(closed).await, "the server never saw the client go");
}

/// Whether the server saw the client close within 10 s (waited on a blocking thread, so the
/// runtime goes on and drops what was aborted).
async fn seen_closed(closed: mpsc::Receiver<()>) -> bool {
    tokio::task::spawn_blocking(move || closed.recv_timeout(Duration::from_secs(10)).is_ok()).await.unwrap_or(false)
}

#[tokio::test]
async fn a_silent_server_is_a_timeout_and_a_closed_port_an_error() {
    let (addr, _, _) = server(vec![]);
    let e = Request::get(&addr.to_string(), "/").timeout(Duration::from_millis(200)).send().await.expect_err("silent");
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    let free = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port");
    let e = get(&free.to_string(), "/").await.expect_err("nothing listens");
    assert!(matches!(e, Error::Http(_)) && e.to_string().contains("connect"), "{e}");
}

#[tokio::test]
async fn the_blocking_client_works_inside_a_runtime() {
    let (addr, _, _) = server(vec![b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]);
    let r = blocking::get(&addr.to_string(), "/ready").expect("answer");
    assert_eq!((r.status, r.text().as_str()), (200, "ok"));
    let (addr, _, closed) = server(vec![
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"9\r\ndata: 1\n\n\r\n",
        b"9\r\ndata: 2\n\n\r\n",
    ]);
    let mut s = Request::get(&addr.to_string(), "/s").stream_blocking().expect("head");
    assert_eq!(s.next_event().expect("event").as_deref(), Some("1"));
    assert_eq!(s.next_event().expect("event").as_deref(), Some("2"));
    drop(s);
    assert!(closed.recv_timeout(Duration::from_secs(10)).is_ok(), "the server never saw the client go");
}

#[test]
fn a_request_in_flight_is_abandoned_by_dropping_it() {
    let (addr, req, closed) = server(vec![]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let pending = Request::post(&addr.to_string(), "/long").json(&serde_json::json!({})).start();
        let seen = tokio::task::spawn_blocking(move || req.recv_timeout(Duration::from_secs(10))).await;
        assert!(seen.is_ok_and(|r| r.is_ok()), "the request did not arrive");
        drop(pending);
        assert!(seen_closed(closed).await, "the server never saw the client go");
    });
}
