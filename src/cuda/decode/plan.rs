//! The split-KV decode plan: for calls with few query rows per K/V head, which instance, how
//! many slices of the key range (each its own block, merged by a combine pass), and the grid.
//! A pure function of the validated [`Problem`] and the [`DeviceCaps`].

use candle::{bail, DType, Result};

use crate::cuda::device::DeviceCaps;
use crate::cuda::instances::{DecodeInstance, DECODE_INSTANCES, DECODE_ROWS};
use crate::cuda::launch::{dtype_name, to_u32, Launch, Module};
use crate::cuda::operands::pack_flags;
use crate::problem::Problem;

/// A decode plan: the partial pass, and the combine pass when the keys are split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub instance: DecodeInstance,
    pub partial: Launch,
    /// Merges the splits' partial results (only with `splits > 1`).
    pub combine: Option<Launch>,
    /// Slices of the key range, each its own block; 1 writes the output directly.
    pub splits: usize,
    /// Keys per slice (a whole number of K/V tiles).
    pub split_keys: usize,
    /// 16-row packed tiles per K/V head.
    pub m_tiles: usize,
    /// Columns of q/k/v the kernel reads (a multiple of 8).
    pub d_load: usize,
    /// Operands (q, k, v) that must first be packed into a contiguous copy.
    pub pack: [bool; 3],
}

/// The decode path is taken when one K/V head has at most this many packed query rows
/// (`heads / kv_heads * seq_q`): beyond it the prefill kernel's 64-128-row tiles are as full.
pub(crate) const DECODE_MAX_ROWS: usize = 4 * DECODE_ROWS;

/// Most key-range splits of one decode call (the combine kernel's limit).
pub(crate) const MAX_SPLITS: usize = 128;

/// Blocks per SM a decode call aims for (the split count fills `DECODE_WAVES * sms` blocks).
const DECODE_WAVES: usize = 2;

/// The decode plan of `p`, or `None` when `p` is not decode-shaped (f32, too many packed rows
/// per K/V head, or a head wider than every instance): the prefill kernels take it then.
pub(crate) fn plan(p: &Problem, dtype: DType, caps: &DeviceCaps) -> Result<Option<Plan>> {
    let group = p.heads / p.kv_heads;
    let rows_only = p.paged.is_some() || p.prefix.is_some();
    if dtype == DType::F32 || !(rows_only || group * p.max_seq_q <= DECODE_MAX_ROWS) {
        return Ok(None);
    }
    let d_load = p.head_dim.next_multiple_of(8);
    let Some(&first) = DECODE_INSTANCES
        .iter()
        .find(|i| i.d >= d_load && caps.fits(i.smem()))
    else {
        return Ok(None);
    };
    let m_tiles = (group * p.max_seq_q).div_ceil(DECODE_ROWS);
    let (splits, split_keys) = decode_splits(p, caps, first, m_tiles, DECODE_WAVES);
    // A grid the SMs hold at once with a deeper ring too (few sequences: each SM then holds at
    // most two blocks) takes it: two tiles in flight per block instead of one.
    let ctas = splits * p.batch * p.kv_heads * m_tiles;
    let instance = DECODE_INSTANCES
        .iter()
        .filter(|j| {
            (j.d, j.warps) == (first.d, first.warps)
                && j.stages > first.stages
                && caps.fits(j.smem())
                && caps.blocks_per_sm(j.smem(), j.threads(), 0) * caps.sms as usize >= ctas
        })
        .max_by_key(|j| j.stages)
        .copied()
        .unwrap_or(first);
    if p.kv_heads * m_tiles > 65535 || p.batch > 65535 || p.heads > 65535 {
        bail!(
            "flash-attn: decode grid ({splits}, {}, {}) exceeds the CUDA limits",
            p.kv_heads * m_tiles,
            p.batch
        )
    }
    let mut plan = Plan {
        instance,
        partial: Launch {
            module: Module::of(dtype)?,
            function: String::new(),
            grid: (0, (p.kv_heads * m_tiles) as u32, p.batch as u32),
            threads: instance.threads() as u32,
            smem: instance.smem(),
        },
        combine: None,
        splits,
        split_keys,
        m_tiles,
        d_load,
        pack: pack_flags(p, false),
    };
    set_splits(&mut plan, p, dtype, splits, split_keys)?;
    if let Some(n) = p.kernels.overrides.decode_splits {
        let bc = plan.instance.bc();
        let keys = p.max_seq_k.div_ceil(n.max(1)).next_multiple_of(bc).max(bc);
        set_splits(&mut plan, p, dtype, p.max_seq_k.div_ceil(keys).max(1), keys)?;
    }
    Ok(Some(plan))
}

/// Sets the split count, the partial pass's grid and entry point, and the combine pass.
fn set_splits(
    plan: &mut Plan,
    p: &Problem,
    dtype: DType,
    splits: usize,
    split_keys: usize,
) -> Result<()> {
    let dn = dtype_name(dtype)?;
    let mods = p.score.softcap > 0.0 || p.has_alibi || p.score.scale <= 0.0;
    let mods = if mods { "_mods" } else { "" };
    plan.splits = splits;
    plan.split_keys = split_keys;
    plan.partial.grid.0 = to_u32(splits, "splits")?;
    plan.partial.function = format!("flash_decode_{dn}_{}{mods}", plan.instance.suffix());
    plan.combine = (splits > 1).then(|| Launch {
        module: plan.partial.module,
        function: format!("flash_decode_combine_{dn}"),
        grid: (p.total_q as u32, p.heads as u32, 1),
        threads: 128,
        smem: 0,
    });
    Ok(())
}

/// Key splits of a decode call of `m_tiles` packed tiles per K/V head: enough blocks for
/// `waves` blocks per SM, each split at least two K/V tiles long. Returns (splits, keys per
/// split).
fn decode_splits(
    p: &Problem,
    caps: &DeviceCaps,
    i: DecodeInstance,
    m_tiles: usize,
    waves: usize,
) -> (usize, usize) {
    let blocks = p.batch * p.kv_heads * m_tiles;
    let bc = i.bc();
    let want = (waves.max(1) * caps.sms as usize).div_ceil(blocks.max(1));
    let most = p.max_seq_k.div_ceil(2 * bc).clamp(1, MAX_SPLITS);
    let splits = want.clamp(1, most);
    let split_keys = p.max_seq_k.div_ceil(splits).next_multiple_of(bc).max(bc);
    (p.max_seq_k.div_ceil(split_keys).max(1), split_keys)
}

#[cfg(test)]
mod tests {
    use candle::{Device, Tensor};

    use super::*;
    use crate::FlashAttn;

    /// Few packed rows per K/V head take the split-KV decode kernel, split so that a small batch
    /// still fills the GPU; many rows (or f32) take the prefill kernels.
    #[test]
    fn decode_is_split_to_fill_the_gpu() {
        let dev = Device::Cpu;
        let mk = |b: usize, sq: usize, sk: usize| {
            let q = Tensor::zeros((b, sq, 32, 128), DType::BF16, &dev).unwrap();
            let k = Tensor::zeros((b, sk, 8, 128), DType::BF16, &dev).unwrap();
            FlashAttn::new(0.1)
                .causal()
                .problem(&q, &k, &k, None)
                .unwrap()
        };
        let caps = DeviceCaps::SM90;
        let split = |p: &Problem| plan(p, DType::BF16, &caps).unwrap();
        // batch 1, 32k keys: 8 blocks of one tile of rows, split about 33 ways.
        let s = split(&mk(1, 1, 32768)).unwrap();
        assert_eq!(s.m_tiles, 1);
        assert!((30..=40).contains(&s.splits), "{s:?}");
        assert!(s.splits * s.split_keys >= 32768 && (s.splits - 1) * s.split_keys < 32768);
        assert!(s.combine.is_some());
        // Many sequences fill the GPU alone: no split, no combine pass.
        let s = split(&mk(64, 1, 4096)).unwrap();
        assert_eq!((s.splits, s.combine), (1, None));
        // 16 query rows of 4 heads: 64 packed rows, 4 tiles; 17 rows: the prefill kernel.
        assert_eq!(split(&mk(2, 16, 1000)).unwrap().m_tiles, 4);
        assert!(split(&mk(2, 17, 1000)).is_none());
        // Short caches are not split below two tiles per split.
        let s = split(&mk(1, 1, 100)).unwrap();
        assert_eq!(s.splits, 1);
        // The deeper ring where the SMs hold the whole grid with it: batch 1 on the H100, not
        // batch 8 (320 blocks, 2 x 132 fit), nor the A100 (one such block per SM).
        let stages = |p: &Problem, caps: &DeviceCaps| {
            let pl = plan(p, DType::BF16, caps).unwrap().unwrap();
            let i = pl.instance;
            assert_eq!(
                pl.partial.function,
                format!("flash_decode_bf16_{}", i.suffix())
            );
            assert_eq!(pl.partial.smem, i.smem());
            i.stages
        };
        assert_eq!(stages(&mk(1, 1, 32768), &caps), 3);
        assert_eq!(stages(&mk(8, 1, 4096), &caps), 2);
        assert_eq!(stages(&mk(8, 1, 32768), &caps), 2);
        assert_eq!(stages(&mk(1, 1, 32768), &DeviceCaps::SM80), 2);
        assert_eq!(stages(&mk(1, 1, 32768), &DeviceCaps::SM86), 2);
        assert_eq!(caps.blocks_per_sm(DECODE_INSTANCES[1].smem(), 128, 0), 3);
    }

    /// The split override changes only the split count of a decode plan.
    #[test]
    fn decode_override_resplits() {
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 1, 32, 128), DType::BF16, &dev).unwrap();
        let k = Tensor::zeros((1, 32768, 8, 128), DType::BF16, &dev).unwrap();
        let opts = |n| {
            FlashAttn::new(0.1).plan_override(crate::PlanOverride {
                decode_splits: Some(n),
                ..Default::default()
            })
        };
        let caps = DeviceCaps::SM90;
        let at = |o: &FlashAttn| {
            let p = o.problem(&q, &k, &k, None).unwrap();
            plan(&p, DType::BF16, &caps).unwrap().unwrap()
        };
        let base = at(&FlashAttn::new(0.1));
        let pl = at(&opts(100));
        // Whole key tiles per split: 86 splits of 384 keys.
        assert_eq!((pl.splits, pl.split_keys), (86, 384));
        assert_eq!(
            pl.partial.grid,
            (86, base.partial.grid.1, base.partial.grid.2)
        );
        assert_eq!(pl.partial.function, base.partial.function);
        let one = at(&opts(1));
        assert_eq!((one.partial.grid.0, one.combine), (1, None));
    }
}
