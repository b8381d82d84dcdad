//! Bounded waits: a condition polled at [`POLL`] until it holds, or an error that says
//! what did not happen within which bound. Nothing here sleeps to let something happen;
//! the interval is only how often the condition is asked. Async waits use tokio's clock,
//! so they run on a paused clock too; [`blocking`] has the same waits for plain threads.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use crate::{Error, Result};

/// How often a condition is asked.
pub const POLL: Duration = Duration::from_millis(50);

/// Polls `check` until it is true; the error says `what` did not happen within `limit`.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut check: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    poll(what, limit, || {
        let fut = check();
        async move { Ok::<_, std::convert::Infallible>(fut.await.then_some(())) }
    })
    .await
}

/// Polls `check` until it gives `Ok(Some(value))`, and returns the value. `Ok(None)` and
/// `Err` both mean "not yet"; the last error is quoted when `limit` runs out.
pub async fn poll<T, E, F, Fut>(what: &str, limit: Duration, mut check: F) -> Result<T>
where
    E: Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<Option<T>, E>>,
{
    let until = tokio::time::Instant::now() + limit;
    let mut last = None;
    loop {
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = Some(e.to_string()),
        }
        if tokio::time::Instant::now() >= until {
            return Err(timeout(what, limit, last));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Awaits `fut` for at most `limit`; the error says `what` did not happen.
pub async fn within<T>(what: &str, limit: Duration, fut: impl Future<Output = T>) -> Result<T> {
    tokio::time::timeout(limit, fut).await.map_err(|_| timeout(what, limit, None))
}

fn timeout(what: &str, limit: Duration, last: Option<String>) -> Error {
    match last {
        Some(e) => Error::Timeout(format!("{what} did not happen within {limit:?} (last error: {e})")),
        None => Error::Timeout(format!("{what} did not happen within {limit:?}")),
    }
}

/// The same waits for code outside a runtime, on the thread's own clock.
pub mod blocking {
    use std::fmt::Display;
    use std::time::Duration;
    use tokio::time::Instant;

    use super::{timeout, POLL};
    use crate::Result;

    /// Polls `check` until it is true; the error says `what` did not happen within `limit`.
    pub fn eventually(what: &str, limit: Duration, mut check: impl FnMut() -> bool) -> Result<()> {
        poll(what, limit, || Ok::<_, std::convert::Infallible>(check().then_some(())))
    }

    /// Polls `check` until it gives `Ok(Some(value))`; see [`super::poll`].
    pub fn poll<T, E: Display>(
        what: &str,
        limit: Duration,
        mut check: impl FnMut() -> std::result::Result<Option<T>, E>,
    ) -> Result<T> {
        let until = Instant::now() + limit;
        let mut last = None;
        loop {
            match check() {
                Ok(Some(v)) => return Ok(v),
                Ok(None) => {}
                Err(e) => last = Some(e.to_string()),
            }
            if Instant::now() >= until {
                return Err(timeout(what, limit, last));
            }
            std::thread::sleep(POLL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_runs_out_says_what_did_not_happen_and_the_last_error() {
        let e = poll("the answer", Duration::from_secs(1), || async { Err::<Option<()>, _>("refused") })
            .await
            .expect_err("never true");
        let text = e.to_string();
        assert!(text.contains("the answer did not happen within 1s") && text.contains("refused"), "{text}");
        assert!(matches!(e, Error::Timeout(_)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_condition_that_comes_true_ends_the_wait_with_its_value() {
        let mut n = 0;
        let got = poll("three asks", Duration::from_secs(5), || {
            n += 1;
            let v = n;
            async move { Ok::<_, String>((v == 3).then_some(v)) }
        })
        .await
        .expect("true on the third ask");
        assert_eq!(got, 3);
        assert!(eventually("at once", Duration::ZERO, || async { true }).await.is_ok());
        assert!(within("never", Duration::from_millis(10), std::future::pending::<()>()).await.is_err());
    }

    #[test]
    fn the_blocking_wait_is_bounded_too() {
        let e = blocking::eventually("nothing", Duration::from_millis(120), || false).expect_err("never");
        assert!(e.to_string().contains("nothing did not happen"), "{e}");
        let mut asks = 0;
        let got = blocking::poll("the second ask", Duration::from_secs(5), || {
            asks += 1;
            Ok::<_, String>((asks == 2).then_some(asks))
        });
        assert_eq!(got.ok(), Some(2));
    }
}
