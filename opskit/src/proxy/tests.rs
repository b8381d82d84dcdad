//! The fault modes on real loopback sockets: an echo upstream, a client, each mode's bytes.

use super::*;

/// An upstream that echoes what it reads, on a thread per connection.
fn echo() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0 || c.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

fn client(p: &Proxy) -> TcpStream {
    let c = TcpStream::connect(p.addr).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    c
}

#[test]
fn a_delay_holds_every_byte_back_and_keeps_order() {
    let p = Proxy::start(echo()).expect("proxy");
    let mut c = client(&p);
    p.arm(Fault::Delay { base: Duration::from_millis(80), jitter: Duration::from_millis(40) });
    let t0 = Instant::now();
    let mut got = Vec::new();
    for i in 0u8..5 {
        c.write_all(&[i]).expect("write");
        let mut b = [0u8; 1];
        c.read_exact(&mut b).expect("read");
        got.push(b[0]);
    }
    // Five round trips, each delayed at least base - jitter on the way up.
    assert!(t0.elapsed() >= Duration::from_millis(5 * 40), "{:?}", t0.elapsed());
    assert_eq!(got, [0, 1, 2, 3, 4]);
    let k = p.counters();
    assert_eq!(k.delayed_chunks, 5);
    assert!(k.min_delay_ms.is_some_and(|m| m >= 40) && k.max_delay_ms <= 120, "{k:?}");
    p.arm(Fault::None);
    c.write_all(b"x").expect("write");
    let mut b = [0u8; 1];
    c.read_exact(&mut b).expect("read");
    assert_eq!(p.counters().delayed_chunks, 5, "disarmed: no more delays");
}

#[test]
fn a_reset_reaches_the_sender_as_an_rst() {
    let p = Proxy::start(echo()).expect("proxy");
    let mut c = client(&p);
    c.write_all(b"hello").expect("write");
    let mut b = [0u8; 5];
    c.read_exact(&mut b).expect("echo before the fault");
    p.arm(Fault::ResetAfter(2));
    c.write_all(b"abcdef").expect("write");
    // Two bytes pass, then the connection is reset: reads end in ECONNRESET, not EOF.
    let mut rest = Vec::new();
    let err = loop {
        let mut b = [0u8; 16];
        match c.read(&mut b) {
            Ok(0) => panic!("EOF (a FIN), not a reset; read {rest:?}"),
            Ok(n) => rest.extend_from_slice(&b[..n]),
            Err(e) => break e,
        }
    };
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    assert!(rest.len() <= 2, "{rest:?}");
    assert_eq!(p.counters().resets, 1);
}

/// What `c` reads within `wait`: `Some(bytes)` (empty: EOF), `None`: nothing (silence).
fn read_within(c: &mut TcpStream, wait: Duration) -> Option<Vec<u8>> {
    c.set_read_timeout(Some(wait)).expect("timeout");
    let mut b = [0u8; 64];
    match c.read(&mut b) {
        Ok(n) => Some(b[..n].to_vec()),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => None,
        // A reset also ends the connection.
        Err(_) => Some(Vec::new()),
    }
}

#[test]
fn a_blackhole_is_silence_both_ways_until_lifted_then_closes_what_it_hit() {
    let p = Proxy::start(echo()).expect("proxy");
    let mut hit = client(&p);
    hit.write_all(b"ping").expect("write");
    let mut b = [0u8; 4];
    hit.read_exact(&mut b).expect("echo before the blackhole");
    let mut idle = client(&p);
    idle.write_all(b"x").expect("write");
    idle.read_exact(&mut b[..1]).expect("echo before the blackhole");

    p.arm(Fault::Blackhole);
    hit.write_all(b"lost").expect("write");
    assert_eq!(read_within(&mut hit, Duration::from_millis(300)), None, "no echo through a blackhole");
    // A new connection is accepted (no refusal) but goes nowhere.
    let mut late = client(&p);
    late.write_all(b"hello?").expect("write");
    assert_eq!(read_within(&mut late, Duration::from_millis(300)), None, "no answer on a new connection");
    let k = p.counters();
    assert_eq!((k.connections, k.blackholed_connections), (2, 1), "{k:?}");
    assert_eq!(k.blackholed_bytes, 10, "{k:?}");

    p.arm(Fault::None);
    // The connection that lost bytes and the one accepted meanwhile are closed: EOF.
    assert_eq!(read_within(&mut hit, Duration::from_secs(5)), Some(vec![]), "the hit connection is closed");
    assert_eq!(read_within(&mut late, Duration::from_secs(5)), Some(vec![]), "the late connection is closed");
    assert_eq!(p.counters().blackhole_closed, 2);
    // A connection that lost nothing goes on, and so do new ones.
    idle.write_all(b"y").expect("write");
    assert_eq!(read_within(&mut idle, Duration::from_secs(5)), Some(b"y".to_vec()));
    let mut fresh = client(&p);
    fresh.write_all(b"back").expect("write");
    assert_eq!(read_within(&mut fresh, Duration::from_secs(5)), Some(b"back".to_vec()));
}

#[test]
fn a_blackhole_drops_the_receivers_bytes_too() {
    // An upstream that answers each byte it reads 200 ms later.
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let up = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let mut b = [0u8; 1];
            while let Ok(1) = c.read(&mut b) {
                std::thread::sleep(Duration::from_millis(200));
                if c.write_all(b"late answer").is_err() {
                    return;
                }
            }
        }
    });
    let p = Proxy::start(up).expect("proxy");
    let mut c = client(&p);
    c.write_all(b"q").expect("write");
    let mut answer = [0u8; 11];
    c.read_exact(&mut answer).expect("an answer before the blackhole");
    c.write_all(b"r").expect("write");
    // Arm only once "r" went up, so that only its answer meets the blackhole.
    let t0 = Instant::now();
    while p.counters().bytes_forwarded < 2 {
        assert!(t0.elapsed() < Duration::from_secs(5), "the proxy did not forward the second byte");
        std::thread::sleep(Duration::from_millis(5));
    }
    p.arm(Fault::Blackhole);
    assert_eq!(read_within(&mut c, Duration::from_millis(600)), None, "the answer must not cross");
    let k = p.counters();
    assert_eq!((k.bytes_forwarded, k.blackholed_bytes, k.blackholed_reply_bytes), (2, 0, 11), "{k:?}");
    p.arm(Fault::None);
    assert_eq!(read_within(&mut c, Duration::from_secs(5)), Some(vec![]), "closed on lift");
}

/// Reads until `want` bytes came or the connection ended; what came, and how it ended.
fn read_n(c: &mut TcpStream, want: usize) -> (Vec<u8>, Option<std::io::ErrorKind>) {
    let mut got = Vec::new();
    while got.len() < want {
        let mut b = [0u8; 64];
        match c.read(&mut b) {
            Ok(0) => return (got, None),
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(e) => return (got, Some(e.kind())),
        }
    }
    (got, None)
}

#[test]
fn a_reorder_swaps_two_adjacent_runs_of_bytes_once() {
    let p = Proxy::start(echo()).expect("proxy");
    let mut c = client(&p);
    c.write_all(b"xy").expect("write");
    assert_eq!(read_n(&mut c, 2).0, b"xy", "untouched before arming");
    p.arm(Fault::Reorder { after: 4, len: 3 });
    // Across writes (and so reads): the swap is by byte offset, not by chunk.
    c.write_all(b"01234").expect("write");
    c.write_all(b"56789").expect("write");
    c.write_all(b"ABC").expect("write");
    assert_eq!(read_n(&mut c, 13).0, b"0123789456ABC");
    let k = p.counters();
    assert_eq!((k.swaps, k.swapped_bytes, k.bytes_forwarded), (1, 6, 15), "{k:?}");
    c.write_all(b"DEF").expect("write");
    assert_eq!(read_n(&mut c, 3).0, b"DEF", "one swap per arming");
    assert_eq!(p.counters().swaps, 1);
}

#[test]
fn a_reorder_whose_sender_pauses_lets_the_held_bytes_go_unswapped() {
    let p = Proxy::start(echo()).expect("proxy");
    let mut c = client(&p);
    p.arm(Fault::Reorder { after: 0, len: 4 });
    // Less than one run, then silence (a sender waiting for an answer): no deadlock.
    c.write_all(b"ab").expect("write");
    let t0 = Instant::now();
    assert_eq!(read_n(&mut c, 2).0, b"ab");
    assert!(t0.elapsed() >= REORDER_WAIT, "{:?}", t0.elapsed());
    assert_eq!(p.counters().swaps, 0, "nothing came to swap with");
}

#[test]
fn reset_next_after_cuts_only_the_next_connection() {
    let p = Proxy::start(echo()).expect("proxy");
    let mut old = client(&p);
    // An echo proves the proxy accepted it (connect returns before that).
    old.write_all(b"0").expect("write");
    assert_eq!(read_n(&mut old, 1).0, b"0");
    p.arm(Fault::ResetNextAfter(3));
    old.write_all(b"abcdef").expect("write");
    assert_eq!(read_n(&mut old, 6).0, b"abcdef", "a connection opened before arming is not cut");
    let mut next = client(&p);
    next.write_all(b"abcdef").expect("write");
    // Three bytes pass, then RST (which may overtake their echo): reset, never EOF.
    let (got, end) = read_n(&mut next, 6);
    assert!(b"abc".starts_with(&got), "{got:?}");
    assert_eq!(end, Some(std::io::ErrorKind::ConnectionReset));
    let mut later = client(&p);
    later.write_all(b"ghi").expect("write");
    assert_eq!(read_n(&mut later, 3).0, b"ghi", "one connection per arming");
    assert_eq!(p.counters().resets, 1);
}

/// An upstream that greets every connection with `hello world`, then echoes.
fn greeter() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            std::thread::spawn(move || {
                if c.write_all(b"hello world").is_err() {
                    return;
                }
                let mut buf = [0u8; 4096];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0 || c.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[test]
fn a_replies_proxy_faults_the_upstreams_bytes() {
    let p = Proxy::start_replies(greeter()).expect("proxy");
    assert_eq!(p.direction, Direction::Replies);
    p.arm(Fault::ResetNextAfter(5));
    let mut c = client(&p);
    let (got, end) = read_n(&mut c, 11);
    assert!(b"hello".starts_with(&got), "{got:?}");
    assert_eq!(end, Some(std::io::ErrorKind::ConnectionReset));
    // The client's bytes are not counted: a delay on replies holds back the answer only.
    p.arm(Fault::Delay { base: Duration::from_millis(60), jitter: Duration::ZERO });
    let mut c = client(&p);
    assert_eq!(read_n(&mut c, 11).0, b"hello world");
    c.write_all(b"!").expect("write");
    let t0 = Instant::now();
    assert_eq!(read_n(&mut c, 1).0, b"!");
    assert!(t0.elapsed() >= Duration::from_millis(60), "{:?}", t0.elapsed());
    let k = p.counters();
    assert_eq!((k.resets, k.delayed_chunks), (1, 2), "{k:?}");
}

#[test]
fn reset_open_resets_every_open_connection() {
    let p = Proxy::start_replies(greeter()).expect("proxy");
    let mut a = client(&p);
    let mut b = client(&p);
    assert_eq!(read_n(&mut a, 11).0, b"hello world");
    assert_eq!(read_n(&mut b, 11).0, b"hello world");
    assert_eq!(p.reset_open(), 2);
    for c in [&mut a, &mut b] {
        let (got, end) = read_n(c, 1);
        assert_eq!((got.len(), end), (0, Some(std::io::ErrorKind::ConnectionReset)));
    }
    assert_eq!(p.counters().resets, 2);
    let mut fresh = client(&p);
    assert_eq!(read_n(&mut fresh, 11).0, b"hello world", "new connections go on");
}

#[test]
fn a_buffer_keeps_reading_and_delivers_everything_after_release() {
    let p = Proxy::start(echo()).expect("proxy");
    let mut c = client(&p);
    p.arm(Fault::BufferAfter(3));
    // Far more than the socket buffers hold: the write completes only if the proxy keeps reading.
    let mut msg = b"abc".to_vec();
    msg.extend(std::iter::repeat_n(b'x', 4 << 20));
    c.write_all(&msg).expect("the whole write completes");
    p.wait_buffered(4 << 20, Duration::from_secs(10)).expect("held back");
    assert_eq!(read_n(&mut c, 3).0, b"abc", "the bytes before the buffer pass");
    assert_eq!(read_within(&mut c, Duration::from_millis(200)), None, "nothing past the buffer before release");
    p.release();
    c.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let (got, end) = read_n(&mut c, 4 << 20);
    assert_eq!((got.len(), end), (4 << 20, None));
    assert!(got.iter().all(|&b| b == b'x'));
    let k = p.counters();
    assert_eq!((k.buffers, k.buffered_bytes), (1, 4 << 20), "{k:?}");
    assert!(p.wait_buffered(5 << 20, Duration::from_millis(50)).is_err(), "a wait for more than was held runs out");
    // Armed again: what the last buffer held does not count for the next.
    p.arm(Fault::BufferAfter(0));
    assert!(p.wait_buffered(1, Duration::from_millis(100)).is_err(), "nothing held since arming");
    c.write_all(b"12").expect("write");
    p.wait_buffered(2, Duration::from_secs(10)).expect("held by the new buffer");
    assert_eq!(p.counters().buffers, 2);
}

#[test]
fn a_freeze_is_silence_that_keeps_connections_and_delivers_after() {
    let p = Proxy::start(echo()).expect("proxy");
    let mut c = client(&p);
    c.write_all(b"1").expect("write");
    assert_eq!(read_n(&mut c, 1).0, b"1");
    p.arm(Fault::Freeze);
    c.write_all(b"2345").expect("write");
    assert_eq!(read_within(&mut c, Duration::from_millis(300)), None, "silence while frozen");
    let mut late = client(&p);
    late.write_all(b"z").expect("write");
    assert_eq!(read_within(&mut late, Duration::from_millis(300)), None, "a new connection waits too");
    assert!(p.counters().frozen_chunks >= 2, "{:?}", p.counters());
    p.arm(Fault::None);
    for s in [&mut c, &mut late] {
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    }
    assert_eq!(read_n(&mut c, 4).0, b"2345", "delivered after the thaw, in order, on the same connection");
    assert_eq!(read_n(&mut late, 1).0, b"z");
}

#[test]
fn clones_share_one_proxy_that_stops_with_the_last() {
    let p = Proxy::start(echo()).expect("proxy");
    let q = p.clone();
    q.arm(Fault::ResetNextAfter(0));
    drop(q);
    let mut c = client(&p);
    c.write_all(b"a").expect("write");
    assert_eq!(read_n(&mut c, 1).1, Some(std::io::ErrorKind::ConnectionReset), "armed through the clone");
    assert_eq!(p.counters().resets, 1);
}
