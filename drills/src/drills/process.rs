//! Drills that kill, stop or drain processes, one family per module: [`kill`] (SIGKILL of
//! workers), [`stop`] (SIGSTOP), [`drain`] (SIGTERM: rolling restarts, relabel, short grace)
//! [`coordinator_kill`] and [`coordinator_resume`] (a coordinator killed or drained under
//! resuming clients).

mod coordinator_kill;
mod coordinator_resume;
mod drain;
mod kill;
mod stop;

pub(super) use coordinator_kill::CoordinatorKill;
pub(super) use coordinator_resume::{CoordinatorKillResume, CoordinatorRollingDrain};
pub(super) use drain::{DrainGraceShort, RollingDrain, VersionRelabel};
pub(super) use kill::{DecodeKill, PrefillKill};
pub(super) use stop::{DecodeFreezeMigrate, WorkerSigstop};

use super::common::Stream;

/// How a raw SSE stream ended: `Ok(None)` complete (`[DONE]` or a finish reason), `Ok(Some(code))`
/// a typed error event, `Err` it ended with neither (EOF or a failed read).
async fn stream_end(s: &mut Stream) -> Result<Option<String>, String> {
    let mut finished = false;
    loop {
        match s.event().await {
            Ok(Some(data)) => {
                let data = data.trim();
                if data == "[DONE]" {
                    return if finished { Ok(None) } else { Err("[DONE] without a finish reason".into()) };
                }
                let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else { continue };
                if let Some(e) = v.get("error") {
                    let code = e.get("code").and_then(|c| c.as_str()).unwrap_or("(no code)");
                    return Ok(Some(code.to_owned()));
                }
                if v.pointer("/choices/0/finish_reason").is_some_and(|f| !f.is_null()) {
                    finished = true;
                }
            }
            Ok(None) if finished => return Ok(None),
            Ok(None) => return Err("the connection ended without a finish reason or an error".into()),
            Err(e) => return Err(e.to_string()),
        }
    }
}
