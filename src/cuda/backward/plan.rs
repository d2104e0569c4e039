//! Picks the backward kernels of a call and sizes their launches: a pure function of the
//! problem, the dtype and the device's shared-memory limit, unit-tested without a GPU.
//!
//! f16/bf16 calls with head dim 64 or 128 whose q, k, v have unit column stride and 16-byte
//! aligned rows run the tensor-core kernels (`kernels/backward/mma.cuh`); everything else (f32,
//! other head dims up to 512, strided columns) runs the exact f32-arithmetic kernels
//! (`kernels/backward/generic.cuh`). Deterministic plans (the default) give dQ its own pass;
//! otherwise one fused tensor-core kernel computes dK, dV and dQ = dS K per key tile, adds the
//! latter into f32 sums with atomics (five matmuls per pair of tiles instead of seven,
//! run-to-run bit differences in dq), and a last pass converts them.

use candle::{bail, DType, Result};

use super::instances::{BwdMma, BWD_GENERIC_NT, BWD_GENERIC_WARPS, BWD_MMA};
use crate::cuda::plan::MAX_SEQ;
use crate::problem::{Problem, Strides};

/// One kernel launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Launch {
    pub function: String,
    pub grid: (u32, u32, u32),
    pub threads: u32,
    pub smem: usize,
}

/// The three passes of one backward call: D = rowsum(dO ∘ O), then dK/dV, then dQ.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BwdPlan {
    pub dsum: Launch,
    pub dkdv: Launch,
    pub dq: Launch,
    /// The tensor-core instance, or `None` for the exact kernels.
    pub mma: Option<BwdMma>,
    /// dQ is summed with atomics into an f32 buffer (`dq` is then the conversion pass).
    pub atomic: bool,
}

/// Threads and most blocks of the atomic plan's f32 -> T conversion of dq (grid-stride, four
/// elements a thread and step).
const CONVERT_THREADS: usize = 256;
const CONVERT_MAX_BLOCKS: usize = 1 << 16;

/// Element offsets that the tensor-core kernels need 16-byte aligned (8 elements of 2 bytes):
/// every stride and start offset of q, k, v, plus the start offsets of the output and its
/// gradient (contiguous rows of `heads * d`).
fn aligned(p: &Problem, extra_offsets: [usize; 2]) -> bool {
    let ok = |s: &Strides| {
        s.dim == 1
            && [s.offset, s.batch, s.seq, s.head]
                .iter()
                .all(|x| x % 8 == 0)
    };
    ok(&p.q) && ok(&p.k) && ok(&p.v) && extra_offsets.iter().all(|x| x % 8 == 0)
}

fn to_u32(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).map_err(|_| candle::Error::Msg(format!("flash-attn backward: {what} = {x}")))
}

/// The plan for `p` in `dtype`. `offsets` are the start offsets (elements) of the output and of
/// its gradient; `max_smem` the device's opt-in shared memory per block; `deterministic`
/// forbids atomics (the exact kernels never use them).
pub(crate) fn plan(
    p: &Problem,
    dtype: DType,
    offsets: [usize; 2],
    max_smem: usize,
    deterministic: bool,
) -> Result<BwdPlan> {
    let d = p.head_dim;
    if d == 0 || d > 32 * BWD_GENERIC_NT[BWD_GENERIC_NT.len() - 1] {
        bail!("flash-attn backward: head_dim {d} is not supported on CUDA (1..=512)")
    }
    if p.max_seq_q.max(p.max_seq_k) > MAX_SEQ {
        bail!("flash-attn backward: sequences longer than {MAX_SEQ} are not supported")
    }
    if p.heads > 65535 || p.batch > 65535 {
        bail!(
            "flash-attn backward: {} heads x {} sequences exceed the CUDA grid (65535 each)",
            p.heads,
            p.batch
        )
    }
    let prefix = match dtype {
        DType::BF16 => "flash_bwd_bf16",
        DType::F16 => "flash_bwd_f16",
        DType::F32 => "flash_bwd_f32",
        dt => bail!("flash-attn backward: unsupported dtype {dt:?}"),
    };
    let (heads, kv_heads, batch) = (
        to_u32(p.heads, "heads")?,
        to_u32(p.kv_heads, "kv_heads")?,
        to_u32(p.batch, "batch")?,
    );
    let generic_threads = (32 * BWD_GENERIC_WARPS) as u32;
    let dsum = Launch {
        function: format!("{prefix}_dsum"),
        grid: (
            to_u32(p.total_q.div_ceil(BWD_GENERIC_WARPS), "rows")?,
            heads,
            1,
        ),
        threads: generic_threads,
        smem: 0,
    };
    let mods = p.has_alibi || p.score.softcap > 0.0;
    let suffix = if mods { "_mods" } else { "" };
    let mma = BWD_MMA
        .iter()
        .find(|i| {
            i.d == d && dtype != DType::F32 && aligned(p, offsets) && i.max_smem() <= max_smem
        })
        .copied();
    let atomic = mma.is_some() && !deterministic;
    let (dkdv, dq) = match mma {
        Some(i) if atomic => {
            let n = p.total_q * p.heads * d / 4;
            (
                Launch {
                    function: format!("{prefix}_dkdvq_d{d}{suffix}"),
                    grid: (
                        to_u32(p.max_seq_k.div_ceil(i.f_bn), "key tiles")?,
                        kv_heads,
                        batch,
                    ),
                    threads: BwdMma::F_THREADS as u32,
                    smem: i.f_smem(),
                },
                Launch {
                    function: format!("{prefix}_dq_convert"),
                    grid: (
                        n.div_ceil(CONVERT_THREADS).min(CONVERT_MAX_BLOCKS) as u32,
                        1,
                        1,
                    ),
                    threads: CONVERT_THREADS as u32,
                    smem: 0,
                },
            )
        }
        Some(i) => (
            Launch {
                function: format!("{prefix}_dkdv_d{d}{suffix}"),
                grid: (
                    to_u32(p.max_seq_k.div_ceil(i.kv_bn()), "key tiles")?,
                    kv_heads,
                    batch,
                ),
                threads: (32 * i.kv_warps) as u32,
                smem: i.kv_smem(),
            },
            Launch {
                function: format!("{prefix}_dq_d{d}{suffix}"),
                grid: (
                    to_u32(p.max_seq_q.div_ceil(i.q_bm()), "query tiles")?,
                    heads,
                    batch,
                ),
                threads: (32 * i.q_warps) as u32,
                smem: i.q_smem(),
            },
        ),
        None => {
            let nt = *BWD_GENERIC_NT
                .iter()
                .find(|&&nt| 32 * nt >= d)
                .expect("head_dim checked above");
            (
                Launch {
                    function: format!("{prefix}_dkdv_generic_{nt}"),
                    grid: (
                        to_u32(p.max_seq_k.div_ceil(BWD_GENERIC_WARPS), "key tiles")?,
                        kv_heads,
                        batch,
                    ),
                    threads: generic_threads,
                    smem: 0,
                },
                Launch {
                    function: format!("{prefix}_dq_generic_{nt}"),
                    grid: (
                        to_u32(p.max_seq_q.div_ceil(BWD_GENERIC_WARPS), "query tiles")?,
                        heads,
                        batch,
                    ),
                    threads: generic_threads,
                    smem: 0,
                },
            )
        }
    };
    Ok(BwdPlan {
        dsum,
        dkdv,
        dq,
        mma,
        atomic,
    })
}

#[cfg(test)]
mod tests {
    use candle::{Device, Tensor};

    use super::*;
    use crate::FlashAttn;

    const H100_SMEM: usize = 232_448;
    const A100_SMEM: usize = 166_912;

    fn problem(d: usize, dtype: DType, opts: &FlashAttn, sq: usize, sk: usize) -> Problem {
        let dev = Device::Cpu;
        let q = Tensor::zeros((2, sq, 6, d), dtype, &dev).unwrap();
        let k = Tensor::zeros((2, sk, 3, d), dtype, &dev).unwrap();
        opts.problem(&q, &k, &k, None).unwrap()
    }

    /// Every head dim 1..=512 gets a plan on the A100 and H100 limits: tensor cores for f16/bf16
    /// at 64 and 128, the exact kernels (wide enough for the head) elsewhere; grids cover every
    /// row and key; softcap / ALiBi take the `_mods` instances.
    #[test]
    fn every_head_dim_is_planned() {
        let slopes = Tensor::new(&[0.5f32, 0.25, 0.125, 0.1, 0.2, 0.3], &Device::Cpu).unwrap();
        let opts = [
            FlashAttn::new(0.1).causal(),
            FlashAttn::new(0.1).softcap(5.0),
            FlashAttn::new(0.1).alibi(&slopes),
        ];
        for smem in [A100_SMEM, H100_SMEM] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                for o in &opts {
                    for d in 1..=512 {
                        let p = problem(d, dtype, o, 37, 141);
                        let pl = plan(&p, dtype, [0, 0], smem, true).unwrap();
                        let what = format!("{dtype:?} d {d} {o:?}: {pl:?}");
                        let fast = dtype != DType::F32 && (d == 64 || d == 128);
                        assert_eq!(pl.mma.is_some(), fast, "{what}");
                        let mods = o.softcap.is_some() || o.alibi_slopes.is_some();
                        match pl.mma {
                            Some(i) => {
                                assert!(i.max_smem() <= smem, "{what}");
                                assert!(!pl.atomic, "{what}");
                                let fast = plan(&p, dtype, [0, 0], smem, false).unwrap();
                                assert!(fast.atomic && fast.dkdv.function.contains("_dkdvq_"));
                                assert_eq!(fast.dkdv.function.ends_with("_mods"), mods, "{what}");
                                assert!(fast.dkdv.grid.0 as usize * i.f_bn >= 141, "{what}");
                                assert_eq!((fast.dkdv.grid.1, fast.dkdv.grid.2), (3, 2));
                                assert!(fast.dq.function.ends_with("_dq_convert"), "{what}");
                                assert!(
                                    fast.dq.grid.0 as usize * CONVERT_THREADS * 4
                                        >= (2 * 37 * 6 * d).min(CONVERT_MAX_BLOCKS * 1024)
                                );
                                assert!(pl.dkdv.grid.0 as usize * i.kv_bn() >= 141, "{what}");
                                assert!(pl.dq.grid.0 as usize * i.q_bm() >= 37, "{what}");
                                assert_eq!(pl.dq.function.ends_with("_mods"), mods, "{what}");
                            }
                            None => {
                                let exact = plan(&p, dtype, [0, 0], smem, false).unwrap();
                                assert!(!exact.atomic, "{what}: the exact kernels use no atomics");
                                let nt: usize =
                                    pl.dq.function.rsplit('_').next().unwrap().parse().unwrap();
                                assert!(32 * nt >= d && (nt == 2 || 16 * nt < d), "{what}");
                                assert!(pl.dkdv.grid.0 as usize * BWD_GENERIC_WARPS >= 141);
                            }
                        }
                        assert_eq!((pl.dkdv.grid.1, pl.dkdv.grid.2), (3, 2), "{what}");
                        assert_eq!((pl.dq.grid.1, pl.dq.grid.2), (6, 2), "{what}");
                        assert!(
                            pl.dsum.grid.0 as usize * BWD_GENERIC_WARPS >= 2 * 37,
                            "{what}"
                        );
                    }
                }
            }
        }
        // Validation already refuses it; the planner names head_dim on its own too.
        let mut p = problem(512, DType::BF16, &opts[0], 3, 3);
        p.head_dim = 513;
        let err = plan(&p, DType::BF16, [0, 0], H100_SMEM, true).unwrap_err();
        assert!(err.to_string().contains("head_dim 513"), "{err}");
    }

    /// Misaligned or column-strided operands, and too little shared memory, fall back to the
    /// exact kernels instead of failing.
    #[test]
    fn unaligned_operands_take_the_exact_kernels() {
        let o = FlashAttn::new(0.1);
        let p = problem(128, DType::BF16, &o, 64, 64);
        assert!(plan(&p, DType::BF16, [0, 0], H100_SMEM, false)
            .unwrap()
            .mma
            .is_some());
        assert!(plan(&p, DType::BF16, [4, 0], H100_SMEM, false)
            .unwrap()
            .mma
            .is_none());
        assert!(plan(&p, DType::BF16, [0, 0], 49_152, true)
            .unwrap()
            .mma
            .is_none());
        let mut strided = p.clone();
        strided.k.dim = 2;
        assert!(plan(&strided, DType::BF16, [0, 0], H100_SMEM, false)
            .unwrap()
            .mma
            .is_none());
        let mut offset = p.clone();
        offset.v.offset = 3;
        assert!(plan(&offset, DType::BF16, [0, 0], H100_SMEM, false)
            .unwrap()
            .mma
            .is_none());
    }
}
