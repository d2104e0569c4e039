//! Which arithmetic the CPU path multiplies its tiles with: chosen per call from the CPU and the
//! dtype, or forced through [`PlanOverride::cpu_matmul`](crate::PlanOverride::cpu_matmul).

use candle::{bail, Result};

use super::elem::Elem;
use super::kernel::Isa;
use crate::problem::Problem;

/// The arithmetic of the CPU path's two tile products (`Q Kᵀ` and `P V`, and the five products of
/// the backward pass), forced with [`PlanOverride::cpu_matmul`](crate::PlanOverride::cpu_matmul)
/// for benchmarks and for tests that reach every path on one machine. Without it the CPU picks
/// for bf16 inputs [`Amx`](Self::Amx) in the forward pass where it can run, else
/// [`Avx512Bf16`](Self::Avx512Bf16) where that beats the f32 products (AMD CPUs; on Intel's the
/// f32 FMAs are faster), else [`F32`](Self::F32); for f16 and f32 inputs always
/// [`F32`](Self::F32). The backward pass on AMX is forced only: on Sapphire Rapids (two
/// threads, 8 heads) it ran 0.5 to 0.9 times the f32 backward at 1024 tokens and 0.9 to 1.7
/// times at 4096, where the AMX forward ran 1.6 to 3.7 times the f32 one.
///
/// The bf16 paths accumulate in f32 and round the probabilities `P` (and in the backward pass
/// `dS`) to bf16 before their product, as the GPU kernels do; the f32 paths convert every tile
/// to f32 first. All agree within bf16 rounding, and each is bitwise deterministic whatever the
/// thread count.
///
/// The override applies to prefill and backward calls; decode calls (a few query rows per K/V
/// head) keep their own kernels, as do f16 and f32 inputs forced to a bf16 path. Forcing a path
/// the CPU does not have (or, for AMX, that the operating system does not let the process use)
/// makes the call fail with an error naming it, whatever the dtype.
///
/// ```
/// use candle_flash::{CpuMatmul, FlashAttn, PlanOverride};
/// let opts = FlashAttn::new(0.125).plan_override(PlanOverride {
///     cpu_matmul: Some(CpuMatmul::F32),
///     ..PlanOverride::default()
/// });
/// # let q = candle::Tensor::zeros((1, 8, 1, 16), candle::DType::BF16, &candle::Device::Cpu)?;
/// // bf16 inputs, products in f32 as on a CPU without bf16 arithmetic.
/// let out = opts.forward(&q, &q, &q)?;
/// # Ok::<(), candle::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpuMatmul {
    /// bf16 tiles on the AMX tile unit (`TDPBF16PS`); Linux x86-64 CPUs with AMX-BF16 and
    /// AVX512-BF16 whose kernel grants the process the tile data state.
    Amx,
    /// bf16 pairs with AVX512-BF16 dot products (`VDPBF16PS`).
    Avx512Bf16,
    /// Tiles converted to f32, products with the best f32 micro-kernel of the CPU (AVX-512, else
    /// AVX2 with FMA, else plain loops).
    F32,
    /// Tiles converted to f32, the AVX2 + FMA micro-kernel (what a CPU without AVX-512 runs).
    F32Avx2,
    /// Tiles converted to f32, plain loops (what a CPU without AVX2 runs).
    F32Portable,
}

/// What one call runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Path {
    /// bf16 products on an engine; the online softmax and the rest in AVX-512.
    Bf16(Engine),
    /// f32 products with these micro-kernels.
    F32(Isa),
}

/// The bf16 product engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Engine {
    Amx,
    Avx512Bf16,
}

/// The path of a call with elements `T` (its backward pass with `backward`), from the override
/// or the CPU.
pub(super) fn choose<T: Elem>(p: &Problem, backward: bool) -> Result<Path> {
    let forced = p.kernels.overrides.cpu_matmul;
    if let Some(m) = forced {
        check_available(m)?;
    }
    Ok(match (forced, T::IS_BF16) {
        (Some(CpuMatmul::Amx), true) => Path::Bf16(Engine::Amx),
        (Some(CpuMatmul::Avx512Bf16), true) => Path::Bf16(Engine::Avx512Bf16),
        (Some(CpuMatmul::F32Avx2), _) => Path::F32(avx2_isa()),
        (Some(CpuMatmul::F32Portable), _) => Path::F32(Isa::Portable),
        (None, true) if amx_usable() && !backward => Path::Bf16(Engine::Amx),
        (None, true) if dot_pays() => Path::Bf16(Engine::Avx512Bf16),
        // Forced F32, a bf16 engine forced on f16/f32 inputs, or no bf16 arithmetic here.
        _ => Path::F32(Isa::detect()),
    })
}

impl CpuMatmul {
    /// Every path this machine can run (AMX only where the OS grants it), bf16 engines first.
    pub fn available() -> Vec<CpuMatmul> {
        [
            CpuMatmul::Amx,
            CpuMatmul::Avx512Bf16,
            CpuMatmul::F32,
            CpuMatmul::F32Avx2,
            CpuMatmul::F32Portable,
        ]
        .into_iter()
        .filter(|&m| check_available(m).is_ok())
        .collect()
    }

    /// The path prefill calls (or with `backward`, backward calls) with inputs of `dtype` take
    /// here without an override.
    pub fn auto(dtype: candle::DType, backward: bool) -> CpuMatmul {
        match dtype {
            candle::DType::BF16 if amx_usable() && !backward => CpuMatmul::Amx,
            candle::DType::BF16 if dot_pays() => CpuMatmul::Avx512Bf16,
            _ => CpuMatmul::F32,
        }
    }
}

/// The AVX2 instruction set (only asked for after [`check_available`] said the CPU has it).
fn avx2_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    return Isa::Avx2Fma;
    #[cfg(not(target_arch = "x86_64"))]
    Isa::Portable
}

/// An error naming `m` unless this CPU (and OS) can run it.
fn check_available(m: CpuMatmul) -> Result<()> {
    let (ok, what) = match m {
        CpuMatmul::Amx => (
            amx_usable(),
            if amx_present() {
                "the operating system refused this process the AMX tile data state"
            } else {
                "this CPU has no AMX-BF16 (or no AVX512-BF16 beside it)"
            },
        ),
        CpuMatmul::Avx512Bf16 => (avx512bf16(), "this CPU has no AVX512-BF16"),
        CpuMatmul::F32 | CpuMatmul::F32Portable => (true, ""),
        CpuMatmul::F32Avx2 => (avx2(), "this CPU has no AVX2 with FMA"),
    };
    if !ok {
        bail!("flash-attn: plan_override cpu_matmul {m:?} cannot run here: {what}")
    }
    Ok(())
}

/// Whether `VDPBF16PS` beats the f32 micro-kernel here, so that bf16 calls without AMX take it:
/// on AMD (Zen 4: one 512-bit `VDPBF16PS` per cycle, 64 flops against 32 of an FMA; prefill
/// 1.6 to 2.0 times the f32 path, backward 1.2 to 1.5 times), not on Intel (Sapphire Rapids,
/// where AMX is refused: prefill 0.46 to 0.77 times the f32 path with its two FMA ports,
/// backward 0.4 to 0.55 times). Asked once per process: CPUID exits to the hypervisor in a
/// virtual machine, microseconds that a short decode call would pay every time.
fn dot_pays() -> bool {
    static PAYS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PAYS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let v = std::arch::x86_64::__cpuid(0);
            let vendor = [v.ebx, v.edx, v.ecx].map(u32::to_le_bytes).concat();
            avx512bf16() && vendor == b"AuthenticAMD"
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// AVX2 with FMA.
fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Everything the bf16 paths use besides the tile unit: AVX-512 F/BW/VL for the softmax and the
/// packing, AVX512-BF16 for the dot products and the rounding to bf16.
pub(super) fn avx512bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bf16")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22) and the OS enabled
/// their state (XCR0 bits 17 and 18); whether the process may use it is [`amx_usable`].
fn amx_present() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__cpuid, __cpuid_count, _xgetbv};
        let leaf7 = __cpuid_count(7, 0);
        if (leaf7.edx >> 24) & 1 == 0 || (leaf7.edx >> 22) & 1 == 0 {
            return false;
        }
        // OSXSAVE: the OS manages XCR0, so XGETBV may be executed.
        if (__cpuid(1).ecx >> 27) & 1 == 0 || !is_x86_feature_detected!("xsave") {
            return false;
        }
        // SAFETY: xsave is available (checked above), which is all XGETBV needs.
        let xcr0 = unsafe { _xgetbv(0) };
        (xcr0 >> 17) & 3 == 3
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// AMX can run in this process: present, AVX512-BF16 beside it, and on Linux the kernel granted
/// the tile data state (asked for once per process, the first time this is called).
pub(super) fn amx_usable() -> bool {
    static USABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USABLE.get_or_init(|| amx_present() && avx512bf16() && request_tile_data())
}

/// Asks Linux for permission to use the AMX tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`); without it the first tile instruction kills the process.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_data() -> bool {
    /// `SYS_arch_prctl`, `ARCH_REQ_XCOMP_PERM` and `XFEATURE_XTILEDATA` from the kernel's
    /// uapi headers (asm/unistd_64.h, asm/prctl.h, asm/fpu/xstate.h).
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: u64 = 0x1023;
    const XFEATURE_XTILEDATA: u64 = 18;
    let ret: i64;
    // SAFETY: the arch_prctl system call with a request code and an integer argument; it reads
    // and writes no user memory, and the registers the syscall instruction overwrites (rcx,
    // r11) are declared clobbered.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

/// Other systems: AMX is not used (their way of granting the tile state is not implemented).
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_tile_data() -> bool {
    false
}
