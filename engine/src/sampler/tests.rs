//! Behavioural tests of [`Sampler`]: greedy, seeding, filters, penalties,
//! empirical distributions and logprobs. Statistical tests use fixed seeds,
//! so they are deterministic; their thresholds are p = 0.001 critical values,
//! so a correct sampler passes for essentially any seed.

use super::*;

type TestResult = Result<(), SamplerError>;

fn sampler(f: impl FnOnce(&mut SamplingParams)) -> Sampler {
    let mut p = SamplingParams::default();
    f(&mut p);
    Sampler::new(&p).expect("test params are valid")
}

fn random_logits(seed: u64, vocab: usize, scale: f64) -> Vec<f32> {
    let mut rng = types::rng::XorShift64::seeded(seed);
    (0..vocab).map(|_| ((rng.unit_f64() - 0.5) * scale) as f32).collect()
}

fn naive_argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn softmax(logits: &[f32], temperature: f64) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f64> = logits.iter().map(|&l| ((f64::from(l) - f64::from(max)) / temperature).exp()).collect();
    let z: f64 = w.iter().sum();
    w.iter().map(|x| x / z).collect()
}

/// Counts over `draws` samples from `s`.
fn histogram(s: &mut Sampler, logits: &[f32], draws: usize) -> Result<Vec<usize>, SamplerError> {
    let mut counts = vec![0; logits.len()];
    for i in 0..draws {
        counts[s.sample(logits, &[], i as u64)?.id as usize] += 1;
    }
    Ok(counts)
}

/// Pearson chi-square statistic over the categories with nonzero expectation;
/// panics if a zero-probability category was drawn.
fn chi_square(counts: &[usize], probs: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(probs)
        .map(|(&c, &p)| {
            if p == 0.0 {
                assert_eq!(c, 0, "drew a token with probability 0");
                return 0.0;
            }
            let e = p * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

#[test]
fn greedy_is_argmax_with_lowest_id_on_ties() -> TestResult {
    let mut s = sampler(|_| {});
    for seed in 0..20 {
        let logits = random_logits(seed, 1000, 20.0);
        assert_eq!(s.sample(&logits, &[], 0)?.id, naive_argmax(&logits));
    }
    assert_eq!(s.sample(&[1.0, 5.0, 0.0, 5.0, 5.0], &[], 0)?.id, 1);
    assert_eq!(s.sample(&[f32::NEG_INFINITY, -3.0, -3.0], &[], 0)?.id, 1);
    Ok(())
}

#[test]
fn seeded_sampling_is_reproducible_and_seeds_differ() -> TestResult {
    let logits = vec![0.0f32; 16];
    let draw = |seed: u64| -> Result<Vec<u32>, SamplerError> {
        let mut s = sampler(|p| {
            p.temperature = 1.0;
            p.seed = Some(seed);
        });
        (0..200).map(|i| s.sample(&logits, &[], i).map(|t| t.id)).collect()
    };
    let a = draw(1)?;
    assert_eq!(a, draw(1)?, "same seed, same tokens");
    let b = draw(2)?;
    assert_ne!(a, b, "different seeds, different tokens");
    // Over 200 uniform draws from 16 tokens, two independent streams agree
    // at about 1/16 of positions; far more agreement means correlated seeds.
    let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
    assert!(same < 40, "{same} of 200 positions agree");
    Ok(())
}

/// Token n depends on (seed, n) alone: a sampler made fresh for draw n (another
/// worker continuing the sequence, a decode worker after remote prefill) picks what
/// the sampler that drew 0..n-1 first picks, and draw 1 is not draw 0 again.
#[test]
fn draws_are_by_position_not_by_history() -> TestResult {
    let logits = random_logits(11, 512, 4.0);
    let params = |p: &mut SamplingParams| {
        p.temperature = 0.8;
        p.top_p = 0.95;
        p.seed = Some(1234);
    };
    let mut first = sampler(params);
    let run: Vec<u32> = (0..64).map(|i| first.sample(&logits, &[], i).map(|t| t.id)).collect::<Result<_, _>>()?;
    for n in [0u64, 1, 17, 63] {
        assert_eq!(sampler(params).sample(&logits, &[], n)?.id, run[n as usize], "draw {n}");
    }
    assert_eq!(first.sample(&logits, &[], 5)?.id, run[5], "asking again gives the same token");
    let distinct: std::collections::HashSet<u32> = run.iter().copied().collect();
    assert!(distinct.len() > 10, "draws vary with the index: {run:?}");
    Ok(())
}

#[test]
fn unseeded_samplers_get_distinct_seeds() {
    let a = sampler(|p| p.temperature = 1.0);
    let b = sampler(|p| p.temperature = 1.0);
    assert_ne!(a.seed(), b.seed());
    assert_eq!(sampler(|p| p.seed = Some(42)).seed(), 42);
}

#[test]
fn top_k_one_equals_greedy_at_any_temperature() -> TestResult {
    // Near-ties that a large temperature squashes to equal weights must still
    // resolve to the true argmax.
    let mut logits = random_logits(3, 4096, 10.0);
    logits[100] = 9.0;
    logits[200] = 9.000_001;
    logits[300] = 9.000_001;
    let want = naive_argmax(&logits);
    assert_eq!(want, 200);
    for temperature in [0.01, 0.5, 1.0, 7.0, 1e4] {
        let mut s = sampler(|p| {
            p.temperature = temperature;
            p.top_k = 1;
            p.seed = Some(9);
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&logits, &[], 0)?.id, want, "T={temperature}");
        }
    }
    Ok(())
}

#[test]
fn subnormal_temperature_is_greedy() -> TestResult {
    let logits = random_logits(6, 5000, 4.0);
    for temperature in [1e-45f32, f32::MIN_POSITIVE / 2.0] {
        let params = SamplingParams { temperature, seed: Some(1), ..SamplingParams::default() };
        assert!(params.is_greedy());
        assert_eq!(Sampler::new(&params)?.sample(&logits, &[], 0)?.id, naive_argmax(&logits));
    }
    let mut tiny = sampler(|p| {
        p.temperature = f32::MIN_POSITIVE;
        p.seed = Some(1);
    });
    assert_eq!(tiny.sample(&logits, &[], 0)?.id, naive_argmax(&logits), "smallest normal");
    Ok(())
}

#[test]
fn tiny_top_p_is_argmax() -> TestResult {
    let logits = random_logits(4, 49_152, 8.0);
    let want = naive_argmax(&logits);
    let mut s = sampler(|p| {
        p.temperature = 1.0;
        p.top_p = 1e-6;
        p.seed = Some(1);
    });
    for _ in 0..50 {
        assert_eq!(s.sample(&logits, &[], 0)?.id, want);
    }
    Ok(())
}

#[test]
fn min_p_drops_unlikely_tokens() -> TestResult {
    // Probabilities 0.5, 0.3, 0.15, 0.05 at T=1.
    let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    let mut s = sampler(|p| {
        p.temperature = 1.0;
        p.min_p = 0.2; // threshold 0.1: token 3 goes
        p.seed = Some(5);
    });
    let counts = histogram(&mut s, &logits, 5000)?;
    assert_eq!(counts[3], 0);
    assert!(counts[2] > 0, "token 2 (0.15 >= 0.1) must stay: {counts:?}");
    let chi = chi_square(&counts, &[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]);
    assert!(chi < 13.82, "chi^2 {chi} (df 2), counts {counts:?}");

    let mut s = sampler(|p| {
        p.temperature = 1.0;
        p.min_p = 0.7; // threshold 0.35: only token 0
        p.seed = Some(5);
    });
    assert_eq!(histogram(&mut s, &logits, 500)?, vec![500, 0, 0, 0]);
    Ok(())
}

#[test]
fn temperature_one_matches_softmax() -> TestResult {
    let logits = [1.0f32, 2.0, 0.5, -1.0];
    let mut s = sampler(|p| {
        p.temperature = 1.0;
        p.seed = Some(42);
    });
    let counts = histogram(&mut s, &logits, 20_000)?;
    let chi = chi_square(&counts, &softmax(&logits, 1.0));
    // df 3, p = 0.001.
    assert!(chi < 16.27, "chi^2 {chi}, counts {counts:?}");
    Ok(())
}

#[test]
fn temperature_and_top_k_renormalise() -> TestResult {
    let logits = [1.0f32, 2.0, 0.5, -1.0, 1.5];
    let mut s = sampler(|p| {
        p.temperature = 0.5;
        p.top_k = 3;
        p.seed = Some(7);
    });
    let counts = histogram(&mut s, &logits, 20_000)?;
    // Top 3 are ids 1, 4, 0; softmax over them at T = 0.5.
    let kept = softmax(&[2.0, 1.5, 1.0], 0.5);
    let probs = [kept[2], kept[0], 0.0, 0.0, kept[1]];
    let chi = chi_square(&counts, &probs);
    assert!(chi < 13.82, "chi^2 {chi} (df 2), counts {counts:?}");
    Ok(())
}

#[test]
fn top_p_keeps_nucleus_and_renormalises() -> TestResult {
    let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    let mut s = sampler(|p| {
        p.temperature = 1.0;
        p.top_p = 0.75; // 0.5 < 0.75 <= 0.8: keep tokens 0 and 1
        p.seed = Some(11);
    });
    let counts = histogram(&mut s, &logits, 20_000)?;
    let chi = chi_square(&counts, &[0.625, 0.375, 0.0, 0.0]);
    assert!(chi < 10.83, "chi^2 {chi} (df 1), counts {counts:?}");
    Ok(())
}

#[test]
fn masked_tokens_are_never_sampled() -> TestResult {
    let mut logits = vec![0.0f32; 64];
    for l in logits.iter_mut().step_by(2) {
        *l = f32::NEG_INFINITY;
    }
    let mut s = sampler(|p| {
        p.temperature = 3.0;
        p.seed = Some(2);
    });
    for i in 0..2000 {
        assert_eq!(s.sample(&logits, &[], i)?.id % 2, 1);
    }
    Ok(())
}

#[test]
fn penalties_change_the_argmax() -> TestResult {
    let logits = [2.0f32, 1.9, 0.0];
    let greedy = |f: &dyn Fn(&mut SamplingParams), history: &[u32]| {
        let mut p = SamplingParams::default();
        f(&mut p);
        Sampler::new(&p)?.sample(&logits, history, 0).map(|t| t.id)
    };
    assert_eq!(greedy(&|_| {}, &[0])?, 0, "no penalty");
    assert_eq!(greedy(&|p| p.presence_penalty = 0.5, &[0])?, 1);
    assert_eq!(greedy(&|p| p.presence_penalty = 0.5, &[])?, 0, "empty history");
    // Frequency scales with the count: 2.0 - 0.05 > 1.9 > 2.0 - 3 * 0.05.
    assert_eq!(greedy(&|p| p.frequency_penalty = 0.05, &[0])?, 0);
    assert_eq!(greedy(&|p| p.frequency_penalty = 0.05, &[0, 2, 0, 0])?, 1);
    // Repetition divides a positive logit: 2.0 / 1.2 < 1.9.
    assert_eq!(greedy(&|p| p.repetition_penalty = 1.2, &[0])?, 1);
    // ...and multiplies a negative one: -1.0 * 1.2 < -1.1.
    let mut s = sampler(|p| p.repetition_penalty = 1.2);
    assert_eq!(s.sample(&[-1.0, -1.1], &[0], 0)?.id, 1);
    // A negative presence penalty encourages repeats.
    let mut s = sampler(|p| p.presence_penalty = -2.0);
    assert_eq!(s.sample(&[1.0, 2.0], &[0], 0)?.id, 0);
    // The random path sees penalties too.
    let mut s = sampler(|p| {
        p.temperature = 1.0;
        p.top_k = 1;
        p.presence_penalty = 0.5;
    });
    assert_eq!(s.sample(&logits, &[0], 0)?.id, 1);
    Ok(())
}

#[test]
fn logprobs_are_raw_log_softmax() -> TestResult {
    let logits = random_logits(8, 20, 6.0);
    let mut s = sampler(|p| {
        p.temperature = 1.7;
        p.presence_penalty = 1.5;
        p.repetition_penalty = 1.3;
        p.logprobs = Some(20);
        p.seed = Some(3);
    });
    let t = s.sample(&logits, &[0, 1, 2, 3], 0)?;
    let raw = softmax(&logits, 1.0);
    // The full list is a distribution.
    assert_eq!(t.top.len(), 20);
    let mass: f64 = t.top.iter().map(|&(_, lp)| f64::from(lp).exp()).sum();
    assert!((mass - 1.0).abs() < 1e-5, "mass {mass}");
    // Descending, and each value is the raw (unpenalised, T=1) log-softmax.
    assert!(t.top.windows(2).all(|w| w[0].1 >= w[1].1));
    for &(id, lp) in &t.top {
        assert!((f64::from(lp) - raw[id as usize].ln()).abs() < 1e-5);
    }
    let chosen = t.logprob.expect("logprobs requested");
    assert!((f64::from(chosen) - raw[t.id as usize].ln()).abs() < 1e-5);
    Ok(())
}

#[test]
fn logprob_top_list_ties_and_sizes() -> TestResult {
    let logits = [0.0f32, 2.0, 2.0, f32::NEG_INFINITY, 1.0, 2.0];
    let mut s = sampler(|p| p.logprobs = Some(3));
    let t = s.sample(&logits, &[], 0)?;
    let ids: Vec<u32> = t.top.iter().map(|&(id, _)| id).collect();
    assert_eq!(ids, vec![1, 2, 5]);
    assert_eq!(t.logprob, Some(t.top[0].1));

    let mut s = sampler(|p| p.logprobs = Some(20));
    assert_eq!(s.sample(&logits, &[], 0)?.top.len(), 5, "masked token omitted");

    let mut s = sampler(|p| p.logprobs = Some(0));
    let t = s.sample(&logits, &[], 0)?;
    assert!(t.logprob.is_some() && t.top.is_empty());

    let t = sampler(|_| {}).sample(&logits, &[], 0)?;
    assert_eq!((t.logprob, t.top.len()), (None, 0));
    Ok(())
}

#[test]
fn bad_logits_and_history_are_typed_errors() {
    let mut s = sampler(|p| p.temperature = 1.0);
    assert_eq!(s.sample(&[], &[], 0), Err(SamplerError::EmptyLogits));
    assert_eq!(s.sample(&[0.0, f32::NAN], &[], 0), Err(SamplerError::NanLogit { index: 1 }));
    assert_eq!(s.sample(&[f32::INFINITY, 0.0], &[], 0), Err(SamplerError::InfiniteLogit { index: 0 }));
    assert_eq!(s.sample(&[f32::NEG_INFINITY; 4], &[], 0), Err(SamplerError::AllLogitsMasked));
    let mut greedy = sampler(|_| {});
    assert_eq!(greedy.sample(&[1.0, f32::NAN], &[], 0), Err(SamplerError::NanLogit { index: 1 }));
    let mut penalised = sampler(|p| p.frequency_penalty = 1.0);
    assert_eq!(
        penalised.sample(&[1.0, 2.0], &[1, 5], 0),
        Err(SamplerError::HistoryTokenOutOfRange { token: 5, vocab: 2 })
    );
}

#[test]
fn invalid_params_are_rejected_by_new() {
    let p = SamplingParams { temperature: f32::NAN, ..SamplingParams::default() };
    assert!(matches!(
        Sampler::new(&p),
        Err(SamplerError::InvalidTemperature(t)) if t.is_nan()
    ));
}

#[test]
fn full_pipeline_on_large_vocab_stays_in_the_filtered_set() -> TestResult {
    let logits = random_logits(12, 49_152, 12.0);
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    let top40: Vec<u32> = order[..40].to_vec();
    let mut s = sampler(|p| {
        p.temperature = 0.9;
        p.top_k = 40;
        p.top_p = 0.95;
        p.min_p = 0.01;
        p.seed = Some(8);
        p.logprobs = Some(5);
    });
    for step in 0..200u32 {
        let history: Vec<u32> = (0..step % 7).collect();
        let t = s.sample(&logits, &history, u64::from(step))?;
        assert!(top40.contains(&t.id), "token {} outside top-k", t.id);
        let ids: Vec<u32> = t.top.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, order[..5].to_vec());
    }
    Ok(())
}
