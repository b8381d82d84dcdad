//! The HTTP frontend's connection cap on a real process: with
//! `--http-max-connections 2` and two connections held open (slowloris
//! style: a request head that never ends), a third connection is not
//! served; it is served as soon as one of the two goes away. The held ones
//! count in `tandem_coordinator_http_connections`, read once there is room.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use facts::metrics::coordinator::HTTP_CONNECTIONS;

/// Reads until the answer's head is in or the connection ends; the bytes read.
fn read_head(s: &mut TcpStream) -> std::io::Result<String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                if got.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(String::from_utf8_lossy(&got).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_wait_until_one_goes() -> TestResult {
    // No worker is needed: /health is the process's liveness. The header
    // timeout is long, so the held connections stay until this test drops them.
    let args = [
        "--http",
        "127.0.0.1:0",
        "--grpc",
        "127.0.0.1:0",
        "--decode",
        "127.0.0.1:1",
        "--http-max-connections",
        "2",
        "--http-header-timeout-ms",
        "60000",
    ];
    let coord = start("tandem-coordinator", &args, &["http"])?;
    let h = coord.addr("http")?.to_string();
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(&h)?;
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")?;
        held.push(s);
    }
    // The third connects (the kernel's backlog accepts it) but is not served.
    let mut third = TcpStream::connect(&h)?;
    third.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
    third.set_read_timeout(Some(Duration::from_millis(1500)))?;
    match read_head(&mut third) {
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
        other => return Err(format!("a third connection was served past the cap of 2: {other:?}").into()),
    }
    // One held connection goes: the third is served, promptly.
    drop(held.pop());
    third.set_read_timeout(Some(WAIT))?;
    let t = Instant::now();
    let head = read_head(&mut third)?;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(t.elapsed() < Duration::from_secs(10), "served {:?} after the room opened", t.elapsed());
    drop(third);
    // The one still held counts, and so does the scrape's own connection
    // (the third's end is counted a moment after its answer).
    eventually("2 open connections counted: the held one and the scrape", || {
        metric(&h, HTTP_CONNECTIONS, &[]).is_ok_and(|n| n == 2.0)
    })
    .await?;
    drop(held);
    Ok(())
}
