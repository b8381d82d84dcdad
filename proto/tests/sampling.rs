//! Sampling parameters survive engine -> wire -> engine unchanged, and a bad
//! wire value becomes the engine's typed error, never a silent default.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

use proto::worker::v1::{ErrorKind, SamplingParams, WorkerError};
use types::sampling::{SamplerError, SamplingParams as EngineParams};

fn round_trip(p: &EngineParams) -> Result<EngineParams, SamplerError> {
    let wire = SamplingParams::from(p);
    EngineParams::try_from(&wire)
}

#[test]
fn engine_params_round_trip_through_the_wire() -> Result<(), SamplerError> {
    let cases = [
        EngineParams::default(),
        EngineParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            seed: Some(u64::MAX),
            presence_penalty: -2.0,
            frequency_penalty: 1.5,
            repetition_penalty: 1.1,
            max_tokens: 1,
            stop_token_ids: vec![2, 49151, 0],
            stop_strings: vec!["\n\n".into(), "</s>".into(), "é".into()],
            logprobs: Some(20),
            ignore_eos: true,
            prompt_lookup: false,
        },
        EngineParams {
            temperature: 1.3,
            seed: Some(0),
            logprobs: Some(0),
            max_tokens: u32::MAX,
            stop_token_ids: vec![7],
            ..EngineParams::default()
        },
    ];
    for p in &cases {
        p.validate()?;
        assert_eq!(&round_trip(p)?, p);
    }
    Ok(())
}

#[test]
fn optional_fields_keep_unset_distinct_from_zero() -> Result<(), SamplerError> {
    let unset = SamplingParams::from(&EngineParams::default());
    assert_eq!((unset.seed, unset.logprobs), (None, None));
    let zero = SamplingParams::from(&EngineParams { seed: Some(0), logprobs: Some(0), ..EngineParams::default() });
    assert_eq!((zero.seed, zero.logprobs), (Some(0), Some(0)));
    let back = EngineParams::try_from(&zero)?;
    assert_eq!((back.seed, back.logprobs), (Some(0), Some(0)));
    Ok(())
}

#[test]
fn invalid_wire_values_are_typed_errors() {
    let valid = SamplingParams::from(&EngineParams::default());
    let cases = [
        (SamplingParams { temperature: f32::NAN, ..valid.clone() }, "temperature"),
        (SamplingParams { max_tokens: 0, ..valid.clone() }, "max_tokens"),
        (SamplingParams { top_p: 0.0, ..valid.clone() }, "top_p"),
        (SamplingParams { repetition_penalty: 0.0, ..valid.clone() }, "repetition_penalty"),
        (SamplingParams { logprobs: Some(21), ..valid.clone() }, "logprobs"),
        (SamplingParams { stop_strings: vec![String::new()], ..valid.clone() }, "stop"),
    ];
    for (wire, field) in cases {
        let err = EngineParams::try_from(&wire).expect_err("invalid params must be rejected");
        assert_eq!(err.field(), Some(field), "{err}");
        let wire_err = WorkerError::from(&err);
        assert_eq!(wire_err.kind(), ErrorKind::InvalidArgument);
        assert!(wire_err.message.contains(field), "{}", wire_err.message);
    }
}

#[test]
fn proto3_zero_message_is_rejected_not_defaulted() {
    // An all-zero message (a sender that forgot to set fields) must not turn
    // into a plausible request.
    let err = EngineParams::try_from(&SamplingParams::default()).expect_err("zero params must be rejected");
    assert_eq!(err, SamplerError::InvalidTopP(0.0));
}

#[test]
fn only_transient_and_overload_errors_are_retryable() {
    let retryable: Vec<ErrorKind> = (0..=8)
        .map(|v| ErrorKind::try_from(v).expect("every value 0..=8 is an ErrorKind"))
        .filter(|k| k.is_retryable())
        .collect();
    assert_eq!(retryable, [ErrorKind::Retryable, ErrorKind::Overloaded]);
    assert!(ErrorKind::try_from(9).is_err(), "ErrorKind grew: review is_retryable and this test");
    // An unknown kind from a newer peer decodes as Unspecified: not retryable.
    let from_newer_peer = WorkerError { kind: 99, message: String::new() };
    assert_eq!(from_newer_peer.kind(), ErrorKind::Unspecified);
    assert!(!from_newer_peer.kind().is_retryable());
}
