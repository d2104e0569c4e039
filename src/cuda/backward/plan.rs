//! Picks the backward kernels of a call and sizes their launches: a pure function of the
//! problem, the dtype and the device's shared-memory limit, unit-tested without a GPU.
//!
//! f16/bf16 calls with head dim 64 or 128 whose q, k, v have unit column stride and 16-byte
//! aligned rows run the tensor-core kernels (`kernels/backward/mma.cuh`); everything else (f32,
//! other head dims up to 512, strided columns) runs the exact f32-arithmetic kernels
//! (`kernels/backward/generic.cuh`). dQ has its own pass, so every element is written once in a
//! fixed order: the backward is deterministic. On compute capability 9.0 such calls take the
//! sm_90a pair instead (`kernels/sm90/bwd.cuh`, table `BWD_SM90`) where an instance covers them.
//! Softcap and ALiBi take the `_mods` twins, a bias or a block mask the `_extras` ones (which
//! also take softcap and ALiBi); the Hopper pair takes the first two only.

use candle::{bail, DType, Result};

use super::instances::{BwdMma, Sm90Bwd, BWD_GENERIC_NT, BWD_GENERIC_WARPS, BWD_MMA, BWD_SM90};
use crate::cuda::device::DeviceCaps;
use crate::cuda::launch::{dtype_name, to_u32, Launch, Module, MAX_SEQ};
use crate::cuda::operands::has_zero_stride;
use crate::problem::{Problem, Strides};

/// The three passes of one backward call: D = rowsum(dO ∘ O), then dK/dV, then dQ.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BwdPlan {
    pub dsum: Launch,
    pub dkdv: Launch,
    pub dq: Launch,
    /// The tensor-core instance, or `None` for the exact kernels.
    pub mma: Option<BwdMma>,
    /// The Hopper kernels (dK/dV, dQ) of `dkdv` and `dq`: they take tensor maps of q, k, v and
    /// dO as well, and come from the sm_90a backward module.
    pub sm90: Option<[Sm90Bwd; 2]>,
}

/// The Hopper dK/dV and dQ instances for `p`, if it qualifies: f16/bf16 at a head dim of the
/// table, operands the tensor copies can read (16-byte aligned rows, no broadcast strides), no
/// KV-cache features, and a `_mods` twin where softcap or ALiBi asks for one. `variants` names
/// non-default instances ([`PlanOverride::bwd_sm90_variants`](crate::PlanOverride)).
fn sm90_pair(
    p: &Problem,
    dtype: DType,
    offsets: [usize; 2],
    dev: &DeviceCaps,
    variants: &[String],
) -> Option<[Sm90Bwd; 2]> {
    if !dev.hopper || dtype == DType::F32 || !aligned(p, offsets) {
        return None;
    }
    // The bias and the block mask are read by the `_extras` instances of the portable kernels only.
    if p.paged.is_some() || p.seqused_k.is_some() || p.prefix.is_some() || has_extras(p) {
        return None;
    }
    let (q_rows, k_rows) = p.storage_rows();
    let (q_batches, k_batches) = p.storage_batches();
    if has_zero_stride(&p.q, q_batches, q_rows, p.heads)
        || has_zero_stride(&p.k, k_batches, k_rows, p.kv_heads)
        || has_zero_stride(&p.v, k_batches, k_rows, p.kv_heads)
    {
        return None;
    }
    let mods = p.has_alibi || p.score.softcap > 0.0;
    let pick = |dkdv: bool| {
        let fits = |i: &&Sm90Bwd| {
            i.d == p.head_dim && i.dkdv() == dkdv && (i.mods || !mods) && i.smem() <= dev.smem_optin
        };
        BWD_SM90
            .iter()
            .filter(fits)
            .find(|i| variants.iter().any(|v| v == i.variant))
            .or_else(|| BWD_SM90.iter().filter(fits).find(|i| i.variant.is_empty()))
            .or_else(|| BWD_SM90.iter().find(fits))
            .copied()
    };
    Some([pick(true)?, pick(false)?])
}

/// Whether the call has a bias or a block mask.
fn has_extras(p: &Problem) -> bool {
    p.bias.is_some() || p.block_mask.is_some()
}

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

/// The plan for `p` in `dtype` on `dev`. `offsets` are the start offsets (elements) of the
/// output and of its gradient.
pub(crate) fn plan(
    p: &Problem,
    dtype: DType,
    offsets: [usize; 2],
    dev: &DeviceCaps,
) -> Result<BwdPlan> {
    plan_with(
        p,
        dtype,
        offsets,
        dev,
        &p.kernels.overrides.bwd_sm90_variants,
    )
}

/// [`plan`] with the Hopper instances named in `variants` where they apply.
fn plan_with(
    p: &Problem,
    dtype: DType,
    offsets: [usize; 2],
    dev: &DeviceCaps,
    variants: &[String],
) -> Result<BwdPlan> {
    if let Some(v) = variants.iter().find(|v| {
        !BWD_SM90
            .iter()
            .any(|i| i.variant == v.as_str() && !v.is_empty())
    }) {
        bail!("flash-attn backward: plan_override names no sm_90a backward variant {v:?}")
    }
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
    let mods = p.has_alibi || p.score.softcap > 0.0;
    let g = Grids {
        p,
        module: Module::of(dtype)?,
        dn: dtype_name(dtype)?,
        suffix: match (has_extras(p), mods) {
            (true, _) => "_extras",
            (false, true) => "_mods",
            (false, false) => "",
        },
    };
    let generic = (32 * BWD_GENERIC_WARPS) as u32;
    let dsum = g.launch("dsum".into(), p.total_q, BWD_GENERIC_WARPS, 1, generic, 0)?;
    let dsum = Launch {
        grid: (dsum.grid.0, to_u32(p.heads, "heads")?, 1),
        ..dsum
    };
    if let Some(pair) = sm90_pair(p, dtype, offsets, dev, variants) {
        return Ok(BwdPlan {
            dsum,
            dkdv: g.sm90(&pair[0], p.max_seq_k, p.kv_heads)?,
            dq: g.sm90(&pair[1], p.max_seq_q, p.heads)?,
            mma: None,
            sm90: Some(pair),
        });
    }
    let mma = BWD_MMA
        .iter()
        .find(|i| {
            i.d == d && dtype != DType::F32 && aligned(p, offsets) && i.max_smem() <= dev.smem_optin
        })
        .copied();
    let (dkdv, dq) = match mma {
        Some(i) => (
            g.launch(
                format!("dkdv_d{d}{}", g.suffix),
                p.max_seq_k,
                i.kv_bn(),
                p.kv_heads,
                (32 * i.kv_warps) as u32,
                match has_extras(p) {
                    true => i.kv_smem_extras(),
                    false => i.kv_smem(),
                },
            )?,
            g.launch(
                format!("dq_d{d}{}", g.suffix),
                p.max_seq_q,
                i.q_bm(),
                p.heads,
                (32 * i.q_warps) as u32,
                i.q_smem(),
            )?,
        ),
        None => {
            let nt = *BWD_GENERIC_NT
                .iter()
                .find(|&&nt| 32 * nt >= d)
                .expect("head_dim checked above");
            let w = BWD_GENERIC_WARPS;
            (
                g.launch(
                    format!("dkdv_generic_{nt}"),
                    p.max_seq_k,
                    w,
                    p.kv_heads,
                    generic,
                    0,
                )?,
                g.launch(
                    format!("dq_generic_{nt}"),
                    p.max_seq_q,
                    w,
                    p.heads,
                    generic,
                    0,
                )?,
            )
        }
    };
    Ok(BwdPlan {
        dsum,
        dkdv,
        dq,
        mma,
        sm90: None,
    })
}

/// Names and grids of one call's backward launches. Every grid puts the tile index first:
/// blocks resident together share their streamed operands through L2.
struct Grids<'a> {
    p: &'a Problem,
    module: Module,
    dn: &'static str,
    suffix: &'static str,
}

impl Grids<'_> {
    /// `flash_bwd_{dtype}_{name}` over `len` rows or keys in tiles of `tile`, per head and
    /// sequence.
    fn launch(
        &self,
        name: String,
        len: usize,
        tile: usize,
        heads: usize,
        threads: u32,
        smem: usize,
    ) -> Result<Launch> {
        Ok(Launch {
            module: self.module,
            function: format!("flash_bwd_{}_{name}", self.dn),
            grid: (
                to_u32(len.div_ceil(tile), "tiles")?,
                to_u32(heads, "heads")?,
                to_u32(self.p.batch, "batch")?,
            ),
            threads,
            smem,
        })
    }

    /// The Hopper instance `i` over `len` rows or keys. Packed sequences take the twins that
    /// zero the next sequence's rows in tail tiles.
    fn sm90(&self, i: &Sm90Bwd, len: usize, heads: usize) -> Result<Launch> {
        let varlen = if self.p.varlen.is_some() {
            "_varlen"
        } else {
            ""
        };
        Ok(Launch {
            module: Module::Sm90Bwd,
            function: format!(
                "flash_bwd_sm90_{}_{}{varlen}{}",
                self.dn, i.name, self.suffix
            ),
            threads: Sm90Bwd::THREADS as u32,
            smem: i.smem(),
            ..self.launch(String::new(), len, Sm90Bwd::BLOCK, heads, 0, 0)?
        })
    }
}

#[cfg(test)]
mod tests {
    use candle::{Device, Tensor};

    use super::*;
    use crate::FlashAttn;

    const H100_SMEM: usize = 232_448;
    const A100_SMEM: usize = 166_912;
    const H100: DeviceCaps = DeviceCaps::SM90;

    /// A device of this shared-memory limit without the sm_90a kernels (any GPU but compute
    /// capability 9.0, or the portable path).
    fn portable(max_smem: usize) -> DeviceCaps {
        DeviceCaps {
            smem_optin: max_smem,
            ..DeviceCaps::SM90.portable()
        }
    }

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
                        let pl = plan_with(&p, dtype, [0, 0], &portable(smem), &[]).unwrap();
                        let what = format!("{dtype:?} d {d} {o:?}: {pl:?}");
                        assert_defined(&pl, &what);
                        let fast = dtype != DType::F32 && (d == 64 || d == 128);
                        assert_eq!(pl.mma.is_some(), fast, "{what}");
                        let mods = o.softcap.is_some() || o.alibi_slopes.is_some();
                        match pl.mma {
                            Some(i) => {
                                assert!(i.max_smem() <= smem, "{what}");
                                assert_eq!(pl.dkdv.function.ends_with("_mods"), mods, "{what}");
                                assert!(pl.dkdv.grid.0 as usize * i.kv_bn() >= 141, "{what}");
                                assert!(pl.dq.grid.0 as usize * i.q_bm() >= 37, "{what}");
                                assert_eq!(pl.dq.function.ends_with("_mods"), mods, "{what}");
                            }
                            None => {
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
        let err = plan_with(&p, DType::BF16, [0, 0], &portable(H100_SMEM), &[]).unwrap_err();
        assert!(err.to_string().contains("head_dim 513"), "{err}");
    }

    /// Misaligned or column-strided operands, and too little shared memory, fall back to the
    /// exact kernels instead of failing.
    #[test]
    fn unaligned_operands_take_the_exact_kernels() {
        let o = FlashAttn::new(0.1);
        let p = problem(128, DType::BF16, &o, 64, 64);
        assert!(
            plan_with(&p, DType::BF16, [0, 0], &portable(H100_SMEM), &[])
                .unwrap()
                .mma
                .is_some()
        );
        assert!(
            plan_with(&p, DType::BF16, [4, 0], &portable(H100_SMEM), &[])
                .unwrap()
                .mma
                .is_none()
        );
        assert!(plan_with(&p, DType::BF16, [0, 0], &portable(49_152), &[])
            .unwrap()
            .mma
            .is_none());
        let mut strided = p.clone();
        strided.k.dim = 2;
        assert!(
            plan_with(&strided, DType::BF16, [0, 0], &portable(H100_SMEM), &[])
                .unwrap()
                .mma
                .is_none()
        );
        let mut offset = p.clone();
        offset.v.offset = 3;
        assert!(
            plan_with(&offset, DType::BF16, [0, 0], &portable(H100_SMEM), &[])
                .unwrap()
                .mma
                .is_none()
        );
    }

    /// A bias or a block mask takes the `_extras` twins of the portable kernels, also on Hopper
    /// (the sm_90a pair reads neither), at every head dim and dtype.
    #[test]
    fn bias_and_block_masks_take_the_portable_extras_kernels() {
        let bias = Tensor::zeros((1, 1, 1, 141), DType::F32, &Device::Cpu).unwrap();
        let blocks = Tensor::ones((1, 1, 1, 1), DType::U8, &Device::Cpu).unwrap();
        let opts = [
            FlashAttn::new(0.1).bias(&bias),
            FlashAttn::new(0.1).causal().block_mask(&blocks, 64, 256),
        ];
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for o in &opts {
                for d in [40, 64, 128, 256] {
                    let p = problem(d, dtype, o, 37, 141);
                    for caps in [H100, portable(A100_SMEM)] {
                        let pl = plan_with(&p, dtype, [0, 0], &caps, &[]).unwrap();
                        let what = format!("{dtype:?} d {d} {o:?}: {pl:?}");
                        assert!(pl.sm90.is_none(), "{what}");
                        if let Some(i) = pl.mma {
                            assert!(pl.dkdv.function.ends_with("_extras"), "{what}");
                            assert!(pl.dq.function.ends_with("_extras"), "{what}");
                            assert_eq!(pl.dkdv.smem, i.kv_smem_extras(), "{what}");
                        }
                    }
                }
            }
        }
    }

    /// The plan's three launches are entry points of their modules.
    fn assert_defined(pl: &BwdPlan, what: &str) {
        for l in [&pl.dsum, &pl.dkdv, &pl.dq] {
            let ok = crate::cuda::launch::defined(l);
            assert!(
                ok,
                "no entry point {} in {:?}: {what}",
                l.function, l.module
            );
        }
    }

    /// On Hopper, f16/bf16 calls at head dims 64 and 128 take the sm_90a kernels (both modes:
    /// they use no atomics), with the `_mods` twins for softcap / ALiBi where they exist (d 64);
    /// d 128 with softcap / ALiBi, f32 and other head dims keep the portable plans. Grids cover
    /// every key and query row.
    #[test]
    fn hopper_plans() {
        let slopes = Tensor::new(&[0.5f32, 0.25, 0.125, 0.1, 0.2, 0.3], &Device::Cpu).unwrap();
        let opts = [
            FlashAttn::new(0.1),
            FlashAttn::new(0.1).causal().window(Some(20), None),
            FlashAttn::new(0.1).softcap(5.0),
            FlashAttn::new(0.1).alibi(&slopes),
        ];
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let dn = if dtype == DType::BF16 { "bf16" } else { "f16" };
            for o in &opts {
                let mods = o.softcap.is_some() || o.alibi_slopes.is_some();
                for d in [32, 64, 96, 128, 256] {
                    let p = problem(d, dtype, o, 300, 517);
                    {
                        let pl = plan_with(&p, dtype, [0, 0], &H100, &[]).unwrap();
                        let what = format!("{dtype:?} d {d} {o:?}: {pl:?}");
                        assert_defined(&pl, &what);
                        let hopper = dtype != DType::F32 && (d == 64 || (d == 128 && !mods));
                        assert_eq!(pl.sm90.is_some(), hopper, "{what}");
                        if !hopper {
                            assert_eq!(
                                pl,
                                plan_with(&p, dtype, [0, 0], &portable(H100_SMEM), &[]).unwrap()
                            );
                            continue;
                        }
                        let suffix = if mods { "_mods" } else { "" };
                        let kv = if mods && d == 64 { "_nopp" } else { "" };
                        assert_eq!(
                            pl.dkdv.function,
                            format!("flash_bwd_sm90_{dn}_dkdv_d{d}{kv}{suffix}")
                        );
                        assert_eq!(
                            pl.dq.function,
                            format!("flash_bwd_sm90_{dn}_dq_d{d}{suffix}")
                        );
                        assert!(pl.mma.is_none(), "{what}");
                        // Tile index first: 517 keys in 5 key tiles, 300 rows in 3 query tiles.
                        assert_eq!(pl.dkdv.grid, (5, 3, 2), "{what}");
                        assert_eq!(pl.dq.grid, (3, 6, 2), "{what}");
                        assert_eq!((pl.dkdv.threads, pl.dq.threads), (384, 384));
                        for (l, i) in [
                            (&pl.dkdv, pl.sm90.unwrap()[0]),
                            (&pl.dq, pl.sm90.unwrap()[1]),
                        ] {
                            assert_eq!(l.smem, i.smem(), "{what}");
                            assert!(i.smem() <= H100_SMEM, "{what}");
                        }
                    }
                }
            }
        }
    }

    /// Variant names pick the sm_90a instances they name, one head dim at a time.
    #[test]
    fn hopper_variant_names() {
        let plain = FlashAttn::new(0.1);
        let p = problem(128, DType::BF16, &plain, 300, 517);
        let v = plan_with(&p, DType::BF16, [0, 0], &H100, &["s2".into(), "k64".into()]).unwrap();
        assert_eq!(v.dkdv.function, "flash_bwd_sm90_bf16_dkdv_d128_s2");
        assert_eq!(v.dq.function, "flash_bwd_sm90_bf16_dq_d128_k64");
        // A variant of one head dim leaves the other's default alone.
        let p64 = problem(64, DType::F16, &plain, 300, 517);
        let v = plan_with(
            &p64,
            DType::F16,
            [0, 0],
            &H100,
            &["s2".into(), "q64".into()],
        )
        .unwrap();
        assert_eq!(v.dkdv.function, "flash_bwd_sm90_f16_dkdv_d64_q64");
        assert_eq!(v.dq.function, "flash_bwd_sm90_f16_dq_d64");
        // One name can swap both kernels.
        let v = plan_with(&p64, DType::F16, [0, 0], &H100, &["nopp".into()]).unwrap();
        assert_eq!(v.dkdv.function, "flash_bwd_sm90_f16_dkdv_d64_nopp");
        assert_eq!(v.dq.function, "flash_bwd_sm90_f16_dq_d64_overlap");
        let v = plan_with(&p, DType::BF16, [0, 0], &H100, &["pp".into()]).unwrap();
        assert_eq!(v.dkdv.function, "flash_bwd_sm90_bf16_dkdv_d128_pp");
        assert_eq!(v.dq.function, "flash_bwd_sm90_bf16_dq_d128_pp");
        // A name no instance has is an error, whatever the device.
        let err = plan_with(&p, DType::BF16, [0, 0], &H100, &["nope".into()]).unwrap_err();
        assert!(err.to_string().contains("\"nope\""), "{err}");
        assert!(plan_with(
            &p,
            DType::BF16,
            [0, 0],
            &portable(H100_SMEM),
            &["nope".into()]
        )
        .is_err());
    }

    /// Packed sequences take the `_varlen` twins; what the sm_90a kernels cannot take goes to
    /// the portable ones.
    #[test]
    fn hopper_varlen_and_fallbacks() {
        let p = problem(128, DType::BF16, &FlashAttn::new(0.1), 300, 517);
        // Packed sequences take the `_varlen` twins (they zero the next sequence's rows).
        let mut packed = p.clone();
        packed.varlen = Some(crate::problem::VarLen {
            batch: 2,
            cu_q: vec![0, 300, 600],
            cu_k: vec![0, 517, 1034],
            max_seqlen_q: 300,
            max_seqlen_k: 517,
            total_k: 1034,
            device: None,
            extent: (300, 517),
        });
        let v = plan_with(&packed, DType::BF16, [0, 0], &H100, &[]).unwrap();
        assert_eq!(v.dkdv.function, "flash_bwd_sm90_bf16_dkdv_d128_varlen");
        assert_eq!(v.dq.function, "flash_bwd_sm90_bf16_dq_d128_varlen");
        // Misaligned output offsets, a broadcast K and too little shared memory: portable.
        assert!(plan_with(&p, DType::BF16, [4, 0], &H100, &[])
            .unwrap()
            .sm90
            .is_none());
        let mut bcast = p.clone();
        bcast.k.head = 0;
        assert!(plan_with(&bcast, DType::BF16, [0, 0], &H100, &[])
            .unwrap()
            .sm90
            .is_none());
        let small = DeviceCaps {
            smem_optin: 101_376,
            ..DeviceCaps::SM90
        };
        assert!(plan_with(&p, DType::BF16, [0, 0], &small, &[])
            .unwrap()
            .sm90
            .is_none());
    }
}
