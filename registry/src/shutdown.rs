//! [`StopSignals`]: the SIGTERM/SIGINT handling every long-running tandem
//! process shares (workers, the coordinator, `tandem up`). It lives here
//! because this is the lowest crate all of them depend on; it has nothing to
//! do with etcd.

use tokio::signal::unix::{signal, Signal, SignalKind};

/// SIGTERM and SIGINT handlers, installed when this is created: from then
/// on a stop signal is delivered to [`StopSignals::recv`] instead of
/// killing the process on the spot, so the process can drain. Create it
/// before the process announces itself (prints its addresses or registers
/// in etcd), so a signal sent right after is never lost.
pub struct StopSignals {
    term: Signal,
    int: Signal,
}

impl StopSignals {
    /// Installs the handlers (needs a tokio runtime with signals enabled).
    pub fn install() -> std::io::Result<Self> {
        Ok(Self { term: signal(SignalKind::terminate())?, int: signal(SignalKind::interrupt())? })
    }

    /// Resolves on the next SIGTERM or SIGINT, naming which.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_sigterm_is_received_and_named_instead_of_ending_the_process() {
        let mut s = StopSignals::install().expect("install");
        let pid = std::process::id().to_string();
        let sent = std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill");
        assert!(sent.success());
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), s.recv()).await.expect("delivered");
        assert_eq!(got, "SIGTERM");
    }
}
