//! The HTTP frontend's strict edges, on a real coordinator process (no worker is
//! needed: every case is answered before routing): each request a client, a proxy
//! or an attacker may send that is not a good OpenAI request gets a 4xx whose body
//! is an OpenAI error with a code: a wrong method or unknown path, a request that
//! breaks RFC 9112's `Host` rules, a chunked body whose framing breaks, a body
//! declared over the cap (answered at once, `Expect: 100-continue` or not), and
//! every field tandem does not implement, refused naming it rather than ignored.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use facts::metrics::coordinator::REQUESTS;
use serde_json::{json, Value};

/// One raw exchange on a fresh connection: the bytes sent, the whole answer read
/// until the server closes or `Content-Length` is in (the answer as text).
fn raw(addr: &str, request: &[u8]) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(WAIT))?;
    s.write_all(request)?;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = match s.read(&mut buf) {
            Ok(n) => n,
            // The server closed with our unread bytes in its buffer.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => 0,
            Err(e) => return Err(e),
        };
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
        if let Some(head_end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..head_end]).to_ascii_lowercase();
            let len = head.lines().find_map(|l| l.strip_prefix("content-length:")).and_then(|v| v.trim().parse().ok());
            if len.is_some_and(|len: usize| got.len() >= head_end + 4 + len) {
                break;
            }
        }
    }
    Ok(String::from_utf8_lossy(&got).into_owned())
}

/// The status and the body of a raw answer, the body parsed as an OpenAI error with a code.
fn openai_error(answer: &str) -> Result<(u16, Value), String> {
    let status = answer.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| format!("no status: {answer}"))?;
    let body = answer.split_once("\r\n\r\n").map(|(_, b)| b).ok_or_else(|| format!("no body: {answer}"))?;
    let v: Value = serde_json::from_str(body).map_err(|e| format!("{e}: {answer}"))?;
    let code_ok = v["error"]["code"].as_str().is_some_and(|c| !c.is_empty());
    if !code_ok || !v["error"]["message"].is_string() || !v["error"]["type"].is_string() {
        return Err(format!("not an OpenAI error with a code: {answer}"));
    }
    Ok((status, v["error"].clone()))
}

/// POSTs `body` to `path`: the status and the parsed OpenAI error (Null for a 2xx).
fn refused(h: &str, path: &str, body: &Value) -> Result<(u16, Value), String> {
    let (status, _, text) = post(h, path, body).map_err(|e| e.to_string())?;
    if status < 400 {
        return Ok((status, Value::Null));
    }
    let v = json_of(&text)?;
    if !v["error"]["code"].is_string() {
        return Err(format!("{status} without a code: {text}"));
    }
    Ok((status, v["error"].clone()))
}

#[test]
fn every_refusal_is_an_openai_error_with_a_code() -> TestResult {
    // No worker: every case here is answered before routing. A 1 KiB body cap.
    let args =
        ["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--decode", "127.0.0.1:1", "--max-body-bytes", "1024"];
    let coord = start("tandem-coordinator", &args, &["http"])?;
    let h = coord.addr("http")?.to_string();
    let failures = std::cell::RefCell::new(Vec::new());
    let check = |what: &str, got: Result<(u16, Value), String>, status: u16, code: &str, param: Option<&str>| match got
    {
        Ok((s, e)) if s == status && e["code"] == code && param.is_none_or(|p| e["param"] == p) => {}
        other => failures.borrow_mut().push(format!("{what}: wanted {status} {code} {param:?}, got {other:?}")),
    };

    // The router's own refusals.
    let a = raw(&h, b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
    check("GET on a POST route", openai_error(&a), 405, "method_not_allowed", None);
    assert!(a.to_ascii_lowercase().contains("\r\nallow: post\r\n"), "405 names the allowed method: {a}");
    let a = raw(&h, b"DELETE /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
    check("DELETE /health", openai_error(&a), 405, "method_not_allowed", None);
    let a = raw(&h, b"GET /v2/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
    check("an unknown path", openai_error(&a), 404, "unknown_url", None);
    let a = raw(&h, b"POST /v1/completions/ HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
    check("a trailing slash", openai_error(&a), 404, "unknown_url", None);

    // RFC 9112, 3.2: Host.
    let a = raw(&h, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")?;
    check("HTTP/1.1 without Host", openai_error(&a), 400, "invalid_value", Some("host"));
    let a = raw(&h, b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\nConnection: close\r\n\r\n")?;
    check("two Host headers", openai_error(&a), 400, "invalid_value", Some("host"));
    let a = raw(&h, b"GET /health HTTP/1.1\r\nHost: user@evil\r\nConnection: close\r\n\r\n")?;
    check("a Host with userinfo", openai_error(&a), 400, "invalid_value", Some("host"));
    let a = raw(&h, b"GET /health HTTP/1.0\r\n\r\n")?;
    assert!(a.starts_with("HTTP/1.0 200") || a.starts_with("HTTP/1.1 200"), "HTTP/1.0 needs no Host: {a}");
    let a = raw(&h, b"GET /health HTTP/1.1\r\nHost: \r\nConnection: close\r\n\r\n")?;
    assert!(a.starts_with("HTTP/1.1 200"), "an empty Host is allowed (RFC 9112, 3.2): {a}");

    // Body framing.
    let bad_chunk = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
        Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n";
    check("a broken chunk size", openai_error(&raw(&h, bad_chunk)?), 400, "invalid_body", None);
    // Declared over the cap: 413 at once, before a byte of the body (no 100 Continue,
    // no wait for a body that never comes).
    for expect in ["Expect: 100-continue\r\n", ""] {
        let t = Instant::now();
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{expect}Content-Length: 50000000\r\n\r\n"
        );
        let a = raw(&h, req.as_bytes())?;
        assert!(!a.contains("100 Continue"), "no 100 Continue for a body over the cap: {a}");
        check(&format!("Content-Length over the cap ({expect:?})"), openai_error(&a), 413, "request_too_large", None);
        assert!(t.elapsed() < Duration::from_secs(10), "answered at once, not after a body timeout: {:?}", t.elapsed());
        assert!(a.to_ascii_lowercase().contains("connection: close"), "the unread body closes the connection: {a}");
    }
    // Chunked past the cap: 413 while reading.
    let mut big = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..3 {
        big.extend_from_slice(format!("200\r\n{}\r\n", "a".repeat(0x200)).as_bytes());
    }
    big.extend_from_slice(b"0\r\n\r\n");
    check("chunked over the cap", openai_error(&raw(&h, &big)?), 413, "request_too_large", None);

    // Fields: honoured, or refused naming them; never ignored.
    let completions = |extra: Value| {
        let mut b = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        refused(&h, "/v1/completions", &b)
    };
    let chat = |messages: Value, extra: Value| {
        let mut b = json!({"model": MODEL, "messages": messages, "max_tokens": 2});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        refused(&h, "/v1/chat/completions", &b)
    };
    let user = json!([{"role": "user", "content": "Hi"}]);
    check("best_of 1000", completions(json!({"best_of": 1000})), 400, "unsupported_parameter", Some("best_of"));
    check(
        "logit_bias",
        completions(json!({"logit_bias": {"50": 100}})),
        400,
        "unsupported_parameter",
        Some("logit_bias"),
    );
    check("echo", completions(json!({"echo": true})), 400, "unsupported_parameter", Some("echo"));
    check(
        "an unknown field",
        completions(json!({"guided_json": {}})),
        400,
        "unsupported_parameter",
        Some("guided_json"),
    );
    check("a mistyped field", completions(json!({"temperature": "hot"})), 400, "invalid_value", Some("temperature"));
    check("batched prompts", completions(json!({"prompt": ["a", "b"]})), 400, "unsupported_parameter", Some("prompt"));
    let tools = json!({"tools": [{"type": "function", "function": {"name": "f"}}]});
    check("tools", chat(user.clone(), tools), 400, "unsupported_parameter", Some("tools"));
    check("malformed tools", chat(user.clone(), json!({"tools": "x"})), 400, "unsupported_parameter", Some("tools"));
    let json_mode = json!({"response_format": {"type": "json_object"}});
    check("response_format json", chat(user.clone(), json_mode), 400, "unsupported_parameter", Some("response_format"));
    check("a message as a list", chat(json!([["user", "hi"]]), json!({})), 400, "invalid_value", Some("messages[0]"));
    let named = json!([{"role": "user", "content": "Hi", "name": "bob"}]);
    check("a message's name", chat(named, json!({})), 400, "unsupported_parameter", Some("messages[0].name"));
    let image = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]);
    check("an image part", chat(image, json!({})), 400, "unsupported_parameter", Some("messages[0].content[0]"));
    check(
        "an unknown role",
        chat(json!([{"role": "tool", "content": "x"}]), json!({})),
        400,
        "invalid_value",
        Some("messages[0].role"),
    );
    // Values that ask for nothing pass validation (and, with no worker, end at routing).
    for (what, got) in [
        ("best_of 1", completions(json!({"best_of": 1, "echo": false, "logit_bias": {}, "user": "u-1"}))),
        (
            "text response_format",
            chat(user.clone(), json!({"response_format": {"type": "text"}, "tools": [], "tool_choice": "none"})),
        ),
        ("null fields", chat(user.clone(), json!({"tools": null, "logit_bias": null, "n": 1}))),
    ] {
        match got {
            Ok((status, e)) if status == 503 && (e["code"] == "no_worker" || e["code"] == "worker_unavailable") => {}
            other => {
                failures.borrow_mut().push(format!("{what}: wanted validation to pass (503 at routing), got {other:?}"))
            }
        }
    }
    // A request refused with a Retry-After (no worker: 503) and sent again at once is
    // refused 429 retry_too_soon, told the time left; another request is not.
    let body = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "seed": 5});
    let (status, headers, text) = post(&h, "/v1/completions", &body)?;
    let first = headers.get("retry-after").and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    assert!(status == 503 && first.is_some(), "{status} {first:?} {text}");
    let (status, headers, text) = post(&h, "/v1/completions", &body)?;
    let again = headers.get("retry-after").and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    check("the same request again at once", refused(&h, "/v1/completions", &body), 429, "retry_too_soon", None);
    assert!(status == 429 && again.is_some_and(|a| a >= 1 && Some(a) <= first), "{status} {again:?} {text}");
    let other = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "seed": 6});
    check("another request", refused(&h, "/v1/completions", &other), 503, "no_worker", None);
    let failures = failures.into_inner();
    assert!(failures.is_empty(), "{} case(s) failed:\n{}", failures.len(), failures.join("\n"));

    // Each generation refusal counted under its code (the framing ones too).
    let page = opskit::prom::scrape_blocking(&h)?;
    for (status, code) in [
        ("400", "unsupported_parameter"),
        ("400", "invalid_value"),
        ("413", "request_too_large"),
        ("400", "invalid_body"),
    ] {
        let n = page.sum(REQUESTS, &[("status", status), ("code", code)])?;
        assert!(n >= 1.0, "{REQUESTS}{{status={status},code={code}}} = {n}");
    }
    Ok(())
}
