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
