//! Run-time instruction-set selection.
//!
//! A level is used by default only once its kernels have passed their tests
//! against the scalar reference on a CPU that has it; `TANDEM_ISA` picks a
//! lower level (or, for a level not yet verified, opts in to it).

/// The SIMD level a kernel call uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust; the reference every SIMD path is tested against.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-VNNI (`vpdpbusd` on 256-bit registers) on top of AVX2's set, as CPUs
    /// without AVX-512 have it (e.g. E-core Xeons): the quantized matmuls' integer dot
    /// products; float math runs AVX2's code ([`Isa::float`]).
    AvxVnni,
    /// x86-64 AVX-512 F/BW/VL with VNNI (`vpdpbusd`), on top of AVX2's set.
    Avx512,
}

/// Why `TANDEM_ISA` could not be honoured.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IsaError {
    /// The value names no level the kernels have.
    #[error("TANDEM_ISA={0:?} is not one of scalar, avx2, avxvnni, avx512")]
    Unknown(String),
    /// The level exists but this CPU lacks the flags it needs.
    #[error("TANDEM_ISA={} but this CPU lacks {}", .isa.name(), .missing.join(" "))]
    Unsupported {
        /// The level asked for.
        isa: Isa,
        /// The `/proc/cpuinfo`-style flags it needs that the CPU does not list.
        missing: Vec<&'static str>,
    },
}

impl Isa {
    /// Every level the kernels have, the reference first, then by increasing width.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512];

    /// The level whose code runs `self`'s float math: AVX-VNNI adds only integer dot
    /// products, so its floats are AVX2's.
    pub fn float(self) -> Isa {
        match self {
            Isa::AvxVnni => Isa::Avx2,
            i => i,
        }
    }

    /// Whether this CPU can run `self`'s code (a kernel asked for a level the CPU lacks
    /// falls back to a lower one).
    pub fn available(self) -> bool {
        self.missing().is_empty()
    }

    /// The CPU flags `self` needs that this CPU lacks (empty when it can run `self`).
    pub fn missing(self) -> Vec<&'static str> {
        self.flags().iter().filter(|(_, has)| !has()).map(|(name, _)| *name).collect()
    }

    /// The flags (named as `/proc/cpuinfo` does) each level needs, with their run-time probes.
    #[allow(clippy::type_complexity)]
    fn flags(self) -> &'static [(&'static str, fn() -> bool)] {
        #[cfg(target_arch = "x86_64")]
        {
            const AVX2: [(&str, fn() -> bool); 3] = [
                ("avx2", || is_x86_feature_detected!("avx2")),
                ("fma", || is_x86_feature_detected!("fma")),
                ("f16c", || is_x86_feature_detected!("f16c")),
            ];
            const AVX_VNNI: [(&str, fn() -> bool); 4] =
                [AVX2[0], AVX2[1], AVX2[2], ("avx_vnni", || is_x86_feature_detected!("avxvnni"))];
            const AVX512: [(&str, fn() -> bool); 7] = [
                AVX2[0],
                AVX2[1],
                AVX2[2],
                ("avx512f", || is_x86_feature_detected!("avx512f")),
                ("avx512bw", || is_x86_feature_detected!("avx512bw")),
                ("avx512vl", || is_x86_feature_detected!("avx512vl")),
                ("avx512_vnni", || is_x86_feature_detected!("avx512vnni")),
            ];
            match self {
                Isa::Scalar => &[],
                Isa::Avx2 => &AVX2,
                Isa::AvxVnni => &AVX_VNNI,
                Isa::Avx512 => &AVX512,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            const NEVER: [(&str, fn() -> bool); 1] = [("x86_64", || false)];
            match self {
                Isa::Scalar => &[],
                Isa::Avx2 | Isa::AvxVnni | Isa::Avx512 => &NEVER,
            }
        }
    }

    /// The level to use: the best this CPU has, or the one `TANDEM_ISA`
    /// (`scalar`, `avx2`, `avxvnni`, `avx512`) asks for. An unknown value or a level the
    /// CPU lacks is not silently ignored: it is reported once on stderr and the
    /// best level is used. Callers that would rather refuse to start use
    /// [`Isa::from_env`].
    pub fn detect() -> Isa {
        Self::from_env().unwrap_or_else(|e| {
            static WARN: std::sync::Once = std::sync::Once::new();
            let best = Self::best();
            WARN.call_once(|| eprintln!("tandem kernels: {e}; using {} instead", best.name()));
            best
        })
    }

    /// As [`Isa::detect`], but a `TANDEM_ISA` that cannot be honoured is an error.
    pub fn from_env() -> Result<Isa, IsaError> {
        Self::choose(std::env::var("TANDEM_ISA").ok().as_deref(), Isa::available)
    }

    /// The level for a `TANDEM_ISA` value (`None` or empty: the best level `has` allows).
    pub fn choose(requested: Option<&str>, has: impl Fn(Isa) -> bool) -> Result<Isa, IsaError> {
        let Some(v) = requested.map(str::trim).filter(|v| !v.is_empty()) else {
            return Ok(Self::ALL.into_iter().rev().find(|i| has(*i)).unwrap_or(Isa::Scalar));
        };
        let isa = Self::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(v))
            .ok_or_else(|| IsaError::Unknown(v.to_string()))?;
        if has(isa) {
            Ok(isa)
        } else {
            Err(IsaError::Unsupported { isa, missing: isa.missing() })
        }
    }

    fn best() -> Isa {
        Self::ALL.into_iter().rev().find(|i| i.available()).unwrap_or(Isa::Scalar)
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avxvnni",
            Isa::Avx512 => "avx512",
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

    /// Whether this CPU can run `isa`; when it cannot, says so on stderr with the
    /// missing flags, so a run on such a CPU names what it did not test instead of
    /// passing in silence. Tests loop over [`Isa::ALL`] and skip with this.
    pub fn runnable(test: &str, isa: Isa) -> bool {
        let missing = isa.missing();
        if !missing.is_empty() {
            eprintln!("{test}: SKIPPED-ISA: {} not on this CPU (lacks {})", isa.name(), missing.join(" "));
        }
        missing.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choose_honours_the_request_or_says_why_not() {
        let all = |_: Isa| true;
        let avx2_only = |i: Isa| matches!(i, Isa::Scalar | Isa::Avx2);
        assert_eq!(Isa::choose(None, all), Ok(Isa::Avx512));
        assert_eq!(Isa::choose(Some(""), avx2_only), Ok(Isa::Avx2));
        assert_eq!(Isa::choose(None, |i| i == Isa::Scalar), Ok(Isa::Scalar));
        for isa in Isa::ALL {
            assert_eq!(Isa::choose(Some(isa.name()), all), Ok(isa));
            assert_eq!(Isa::choose(Some(&isa.name().to_uppercase()), all), Ok(isa));
        }
        assert_eq!(Isa::choose(Some("scalar"), avx2_only), Ok(Isa::Scalar));
        assert!(matches!(Isa::choose(Some("avx512"), avx2_only), Err(IsaError::Unsupported { isa: Isa::Avx512, .. })));
        assert_eq!(Isa::choose(Some("avx1024"), all), Err(IsaError::Unknown("avx1024".into())));
        // A CPU with AVX-VNNI but no AVX-512 (E-core Xeons) gets the VNNI matmuls.
        let vnni_no_512 = |i: Isa| i != Isa::Avx512;
        assert_eq!(Isa::choose(None, vnni_no_512), Ok(Isa::AvxVnni));
        assert_eq!(Isa::AvxVnni.float(), Isa::Avx2);
        assert_eq!(Isa::Avx512.float(), Isa::Avx512);
    }

    #[test]
    fn detect_picks_an_available_level_and_unsupported_names_the_flags() {
        assert!(Isa::detect().available());
        assert!(Isa::Scalar.available());
        for isa in Isa::ALL {
            assert_eq!(isa.available(), isa.missing().is_empty(), "{}", isa.name());
            if let Err(IsaError::Unsupported { missing, .. }) = Isa::choose(Some(isa.name()), Isa::available) {
                assert!(!missing.is_empty(), "{} refused with no missing flag", isa.name());
                eprintln!("isa: SKIPPED-ISA: {} not on this CPU (lacks {})", isa.name(), missing.join(" "));
            }
        }
        // Wider levels include the narrower ones' flags, so "best" is well defined.
        assert!(Isa::Avx512.missing().len() >= Isa::Avx2.missing().len());
        assert!(Isa::AvxVnni.missing().len() >= Isa::Avx2.missing().len());
    }
}
