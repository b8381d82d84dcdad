//! The HTTP face of an [`Error`], chosen here and nowhere else: the status
//! (README's error-code table), the OpenAI error body
//! `{"error":{"message","type","param","code"}}` and, where a retry can
//! help, a `Retry-After` header.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use proto::worker::v1::ErrorKind;
use serde_json::Value;

use crate::admission::Shed;
use crate::error::Error;
use crate::router::NoRoute;
use crate::tenants::Cap;

/// The status of an error's answer.
///
/// 502 is for a decode worker that failed the request after its own
/// recovery (`kv_load_failed`, `version_mismatch`) or whose stream broke;
/// 503 (always with Retry-After) for a full or not yet ready cluster; 504
/// for a spent deadline wherever it ran out. A tenant over a rate or count
/// is 429 (with Retry-After); over a cap, 400 (`max_tokens`) or 413 (the
/// prompt); a body that does not arrive in time, 408.
pub fn status(e: &Error) -> StatusCode {
    use ErrorKind as K;
    match e {
        Error::Invalid { .. }
        | Error::InvalidJson { .. }
        | Error::Unsupported { .. }
        | Error::InvalidBody { .. }
        | Error::ContextLength { .. } => StatusCode::BAD_REQUEST,
        Error::UnknownRoute { .. } => StatusCode::NOT_FOUND,
        Error::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
        Error::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        Error::UnsupportedMediaType { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        Error::MissingApiKey | Error::WrongApiKey => StatusCode::UNAUTHORIZED,
        Error::ModelNotFound { .. } => StatusCode::NOT_FOUND,
        Error::IdempotencyKeyReused => StatusCode::UNPROCESSABLE_ENTITY,
        Error::Shed(shed) => match shed {
            Shed::KeyLimit { .. } => StatusCode::TOO_MANY_REQUESTS,
            Shed::QueueFull { .. } | Shed::Closed => StatusCode::SERVICE_UNAVAILABLE,
            Shed::Deadline => StatusCode::GATEWAY_TIMEOUT,
        },
        Error::IdempotencyTableFull
        | Error::IdempotentOriginalFailed
        | Error::NotReady(_)
        | Error::RegistryUnavailable
        | Error::NoRoute { why: NoRoute::NoDecode | NoRoute::NoneReady(_) | NoRoute::PrefillUnavailable(_), .. }
        | Error::WorkerUnavailable(_)
        | Error::MigrationFailed { .. } => StatusCode::SERVICE_UNAVAILABLE,
        Error::WorkerStream(_) => StatusCode::BAD_GATEWAY,
        Error::Worker { kind, .. } => match kind {
            K::InvalidArgument => StatusCode::BAD_REQUEST,
            K::Overloaded | K::Retryable | K::Cancelled => StatusCode::SERVICE_UNAVAILABLE,
            K::Deadline => StatusCode::GATEWAY_TIMEOUT,
            K::KvLoadFailed | K::VersionMismatch => StatusCode::BAD_GATEWAY,
            K::Internal | K::Unspecified => StatusCode::INTERNAL_SERVER_ERROR,
        },
        Error::Deadline => StatusCode::GATEWAY_TIMEOUT,
        Error::TenantLimit { .. } | Error::RetryTooSoon { .. } | Error::RetryBudgetExhausted { .. } => {
            StatusCode::TOO_MANY_REQUESTS
        }
        Error::OverCap { what: Cap::MaxTokens, .. } => StatusCode::BAD_REQUEST,
        Error::OverCap { what: Cap::PromptTokens, .. } => StatusCode::PAYLOAD_TOO_LARGE,
        Error::TokenizerBusy => StatusCode::SERVICE_UNAVAILABLE,
        Error::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
        Error::ResumeMismatch { .. } => StatusCode::CONFLICT,
        Error::Draining => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// The OpenAI error body (also what a streamed answer sends as its last
/// event when it fails after the headers went out).
pub fn body(e: &Error) -> Value {
    let (kind, code) = e.openai();
    serde_json::json!({
        "error": {
            "message": e.to_string(),
            "type": kind,
            "param": e.param(),
            "code": code,
        }
    })
}

/// The error code an answer carries, for the request counter (a response extension,
/// never sent).
#[derive(Clone, Copy, Debug)]
pub struct ErrorCode(pub &'static str);

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let mut r = (status(&self), Json(body(&self))).into_response();
        r.extensions_mut().insert(ErrorCode(self.code()));
        if matches!(self, Error::BodyTimeout { .. } | Error::BodyTooLarge { .. } | Error::InvalidBody { .. }) {
            // The rest of the body may still trickle in, or was never read, or its
            // framing is lost: the connection is not reused, whatever the client asked.
            r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if let Error::MethodNotAllowed { allowed, .. } = &self {
            r.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allowed));
        }
        if let Some(s) = self.retry_after() {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_has_the_openai_shape() {
        let b = body(&Error::invalid("top_p", "bad"));
        assert_eq!(b["error"]["param"], "top_p");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["message"], "bad");
        assert_eq!(b["error"]["code"], "invalid_value", "a plain invalid field has a code too");
    }
}
