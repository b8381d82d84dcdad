//! Run-time instruction-set selection.

/// The SIMD level a kernel call uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust; the reference every SIMD path is tested against.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
}

impl Isa {
    /// Every level the kernels have, the reference first.
    pub const ALL: [Isa; 2] = [Isa::Scalar, Isa::Avx2];

    /// Whether this CPU can run `self`'s code (a kernel asked for a level the CPU lacks
    /// falls back to the scalar reference).
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => Self::best() == Isa::Avx2,
        }
    }

    /// The best level this CPU supports. `TANDEM_ISA=scalar` forces the
    /// reference path (for debugging a suspected SIMD bug in production).
    pub fn detect() -> Isa {
        if std::env::var("TANDEM_ISA").is_ok_and(|v| v.eq_ignore_ascii_case("scalar")) {
            return Isa::Scalar;
        }
        Self::best()
    }

    fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
        }
    }
}

/// Which kernel paths ran on this thread, for tests: asking for an ISA must run that ISA's
/// code, not a silent fallback, and a test can only tell by looking.
#[cfg(test)]
pub(crate) mod trace {
    use super::Isa;
    use std::cell::Cell;

    thread_local! {
        static RAN: Cell<[u64; Isa::ALL.len()]> = const { Cell::new([0; Isa::ALL.len()]) };
    }

    fn index(isa: Isa) -> usize {
        Isa::ALL.iter().position(|i| *i == isa).unwrap_or(0)
    }

    /// Counts one call of `isa`'s code on this thread.
    pub fn hit(isa: Isa) {
        RAN.with(|r| {
            let mut v = r.get();
            v[index(isa)] += 1;
            r.set(v);
        });
    }

    /// The calls counted on this thread since the last take, per ISA; resets them.
    pub fn take() -> [u64; Isa::ALL.len()] {
        RAN.with(|r| r.replace([0; Isa::ALL.len()]))
    }

    /// Runs `f` on this thread and fails unless it ran `isa`'s code and no other's.
    pub fn assert_ran<T>(isa: Isa, what: &str, f: impl FnOnce() -> T) -> T {
        take();
        let out = f();
        let ran = take();
        for (i, n) in Isa::ALL.iter().zip(ran) {
            if *i == isa {
                assert!(n > 0, "{what}: asked for {} but its code never ran ({ran:?} by {:?})", isa.name(), Isa::ALL);
            } else {
                assert_eq!(n, 0, "{what}: asked for {} but {} code ran ({ran:?})", isa.name(), i.name());
            }
        }
        out
    }

    /// The ISAs above scalar this CPU has; each one it lacks is named on stderr, so a run
    /// on such a CPU says what it did not test instead of passing in silence.
    pub fn simd_levels(test: &str) -> Vec<Isa> {
        Isa::ALL
            .into_iter()
            .filter(|i| *i != Isa::Scalar)
            .filter(|i| {
                let ok = i.available();
                if !ok {
                    eprintln!("{test}: SKIPPED {}: this CPU lacks it", i.name());
                }
                ok
            })
            .collect()
    }
}
