//! Executes a [`LaunchPlan`]: operands the kernel cannot read in place are packed, one
//! parameter struct is filled, and the kernel is launched on candle's stream.
//!
//! The kernels are compiled to PTX by `build.rs` (`compute_80`, plus the Hopper module for
//! `compute_90a`), embedded here and loaded once per device; [`ptx`] maps a plan's module to its
//! text. The planner picks the sm_90a module on compute capability 9.0 (not under
//! `CANDLE_FLASH_PORTABLE=1`); its kernels also take the tensor maps of q, k and v, built here per
//! call with `cuTensorMapEncodeTiled`.

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchArgs, LaunchConfig,
    PushKernelArg,
};
use candle::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle::{bail, CudaStorage, DType, Result, Storage, Tensor};
use half::{bf16, f16};

use super::params::Params;
use super::plan::{
    override_decode, override_sm90, plan, sm90_tile_group, DeviceCaps, Kernel, Module, MAX_SEQ,
    SM90_L2_KV_BYTES, STATIC_SMEM_RESERVE,
};
use crate::problem::{Paged, Problem, Strides};
use crate::semantics::LOG2_E;

/// The PTX text and candle's cache name of a module.
fn ptx(m: Module) -> (&'static str, &'static str) {
    match m {
        Module::Bf16 => (
            "candle_flash_bf16",
            include_str!(concat!(env!("OUT_DIR"), "/flash_bf16.ptx")),
        ),
        Module::F16 => (
            "candle_flash_f16",
            include_str!(concat!(env!("OUT_DIR"), "/flash_f16.ptx")),
        ),
        Module::F32 => (
            "candle_flash_f32",
            include_str!(concat!(env!("OUT_DIR"), "/flash_f32.ptx")),
        ),
        Module::Sm90 => (
            "candle_flash_sm90",
            include_str!(concat!(env!("OUT_DIR"), "/flash_sm90.ptx")),
        ),
        Module::Sm90Bwd => (
            "candle_flash_bwd_sm90",
            include_str!(concat!(env!("OUT_DIR"), "/flash_bwd_sm90.ptx")),
        ),
    }
}

pub(super) const PACK_PTX: (&str, &str) = (
    "candle_flash_pack",
    include_str!(concat!(env!("OUT_DIR"), "/pack.ptx")),
);

// SAFETY: `Params` is `#[repr(C)]`, `Copy`, made of plain integers and floats, and its C twin
// `FlashParams` is checked field by field at build time (see params.rs).
unsafe impl DeviceRepr for Params {}

/// What the planner needs, read from the device; `portable` turns the sm_90a kernels off.
pub(crate) fn caps(stream: &CudaStream, portable: bool) -> Result<DeviceCaps> {
    let ctx = stream.context();
    let attr = |a| -> Result<usize> { Ok(ctx.attribute(a).w()? as usize) };
    let caps = DeviceCaps::new(
        attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32,
        attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32,
        attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
        attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
    );
    Ok(if portable || force_portable() {
        caps.portable()
    } else {
        caps
    })
}

/// `CANDLE_FLASH_PORTABLE=1` (read once): the sm_90a kernels stay off and every call takes the
/// portable compute_80 path, for A/B runs and as an escape hatch.
fn force_portable() -> bool {
    static PORTABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PORTABLE.get_or_init(|| {
        std::env::var("CANDLE_FLASH_PORTABLE").is_ok_and(|v| !v.is_empty() && v != "0")
    })
}

/// The driver's `CUtensorMap`: 128 opaque bytes (the kernels' `TmaMap`), passed by value as a
/// `__grid_constant__` kernel parameter.
#[repr(C, align(128))]
#[derive(Clone, Copy)]
pub(crate) struct TmaMap([u64; 16]);

// SAFETY: plain bytes, copied as the kernel parameter of the same size.
unsafe impl DeviceRepr for TmaMap {}

/// A 4-D tensor map (column, head, row, batch) over one operand for the sm_90a kernels: boxes of
/// 64 columns x `box_rows` rows of one head, 128-byte swizzle, zero fill outside the tensor.
pub(crate) fn tma_map(
    ptr: u64,
    s: &Strides,
    esize: usize,
    bf16: bool,
    [cols, heads, rows, batch]: [usize; 4],
    box_rows: usize,
) -> Result<TmaMap> {
    use candle::cuda_backend::cudarc::driver::sys;
    // Strides of axes of extent 1 are never used; the driver still wants multiples of 16.
    let stride = |st: usize, n: usize| -> u64 {
        if n <= 1 {
            (cols * esize).next_multiple_of(16) as u64
        } else {
            (st * esize) as u64
        }
    };
    let dims = [cols, heads, rows, batch].map(|x| x.max(1) as u64);
    let strides = [
        stride(s.head, heads),
        stride(s.seq, rows),
        stride(s.batch, batch),
    ];
    let boxes = [64u32, 1, box_rows as u32, 1];
    let elem_strides = [1u32; 4];
    let mut map = TmaMap([0; 16]);
    // SAFETY: every pointer is to a live local array of the lengths the rank (4) implies; `map`
    // is 128 writable bytes, as large and as aligned as a CUtensorMap.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map as *mut TmaMap as *mut sys::CUtensorMap,
            if bf16 {
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
            } else {
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16
            },
            4,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        bail!("flash-attn: cuTensorMapEncodeTiled failed ({r:?}) for dims {dims:?}, strides {strides:?}")
    }
    Ok(map)
}

/// Window sides for the kernels: -1 unbounded, otherwise clamped so `int` arithmetic on
/// diagonals (sequences < 2^30) cannot overflow; any window that wide already covers everything.
fn window_side(w: i64) -> i64 {
    if w < 0 {
        -1
    } else {
        w.min(MAX_SEQ as i64)
    }
}

/// The fields of [`Params`] that follow from the validated problem alone, shared by the forward
/// and backward launches so the two cannot drift: the strides of q, k and v as the kernel reads
/// them (`strides`: in place, or of packed copies), the contiguous output's layout, the lse
/// layout, the window, lengths (`seq_k`: the key bound, a paged cache's capacity included),
/// heads, the columns read (`d_load`) and written, and the score modifiers. Pointers and the
/// decode / paged / prefix fields stay at their defaults (0, null; one split; no page shift)
/// for the caller.
pub(crate) fn problem_params(
    p: &Problem,
    [q, k, v]: [&Strides; 3],
    d_load: usize,
    seq_k: usize,
) -> Result<Params> {
    let (win_left, win_right) = p.window.as_i64();
    let softcap = p.score.softcap;
    let d = p.head_dim;
    Ok(Params {
        q_batch: q.batch as i64,
        q_seq: q.seq as i64,
        q_head: q.head as i64,
        q_dim: q.dim as i64,
        k_batch: k.batch as i64,
        k_seq: k.seq as i64,
        k_head: k.head as i64,
        k_dim: k.dim as i64,
        v_batch: v.batch as i64,
        v_seq: v.seq as i64,
        v_head: v.head as i64,
        v_dim: v.dim as i64,
        o_seq: (p.heads * d) as i64,
        o_head: d as i64,
        lse_head: p.lse_head_stride() as i64,
        win_left: window_side(win_left),
        win_right: window_side(win_right),
        seq_q: to_i32(p.max_seq_q, "seq_q")?,
        seq_k: to_i32(seq_k, "seq_k")?,
        heads: to_i32(p.heads, "heads")?,
        kv_group: to_i32(p.heads / p.kv_heads, "heads")?,
        d_load: to_i32(d_load, "head_dim")?,
        d_out: to_i32(d, "head_dim")?,
        scale_log2: p.score.scale * LOG2_E,
        softcap,
        scale_over_cap: if softcap > 0.0 {
            p.score.scale / softcap
        } else {
            0.0
        },
        cap_log2: softcap * LOG2_E,
        alibi_batch: to_i32(p.alibi_batch_stride, "alibi stride")?,
        dv_splits: 1,
        num_splits: 1,
        m_tiles: 1,
        total_q: to_i32(p.total_q, "total_q")?,
        total_k: to_i32(p.varlen.as_ref().map_or(0, |vl| vl.total_k), "total_k")?,
        page_shift: -1,
        batch: to_i32(p.batch, "batch")?,
        ..Params::default()
    })
}

/// The forward pass of `p` on the GPU: returns (out, lse). `alibi` holds the slopes when
/// `p.has_alibi`.
pub(crate) fn forward(
    p: &Problem,
    alibi: Option<&Tensor>,
    q: &CudaStorage,
    k: &CudaStorage,
    v: &CudaStorage,
) -> Result<(CudaStorage, CudaStorage)> {
    let dev = q.device().clone();
    match (q.dtype(), k.dtype(), v.dtype()) {
        (DType::BF16, DType::BF16, DType::BF16) => forward_t::<bf16>(p, alibi, &dev, q, k, v),
        (DType::F16, DType::F16, DType::F16) => forward_t::<f16>(p, alibi, &dev, q, k, v),
        (DType::F32, DType::F32, DType::F32) => forward_t::<f32>(p, alibi, &dev, q, k, v),
        (a, b, c) => {
            bail!("flash-attn: q, k, v must share one of f32/f16/bf16, got {a:?}/{b:?}/{c:?}")
        }
    }
}

/// One operand as the kernel reads it: a device address of element (0, 0, 0, 0) and strides.
struct Operand {
    ptr: u64,
    s: Strides,
}

fn forward_t<T: CudaDType + DeviceRepr + candle::WithDType>(
    p: &Problem,
    alibi: Option<&Tensor>,
    dev: &CudaDevice,
    q: &CudaStorage,
    k: &CudaStorage,
    v: &CudaStorage,
) -> Result<(CudaStorage, CudaStorage)> {
    let stream = dev.cuda_stream();
    let (q, k, v) = (
        q.as_cuda_slice::<T>()?,
        k.as_cuda_slice::<T>()?,
        v.as_cuda_slice::<T>()?,
    );
    p.check_bounds(q.len(), k.len(), v.len())?;
    if p.has_alibi != alibi.is_some() {
        bail!("flash-attn: ALiBi slopes do not match the validated problem")
    }
    let caps = caps(&stream, p.kernels.portable)?;
    let mut plan = plan(p, T::DTYPE, &caps)?;
    let o = &p.kernels.overrides;
    if let Some(n) = o.decode_splits {
        override_decode(&mut plan, p, n);
    }
    if o.sm90_variant.is_some() || o.persistent_blocks.is_some() {
        override_sm90(
            &mut plan,
            p,
            &caps,
            o.sm90_variant.as_deref(),
            o.persistent_blocks,
        )?;
    }
    let esize = std::mem::size_of::<T>();
    let d = p.head_dim;

    // Operands: read in place where the plan allows, otherwise through a packed contiguous copy.
    let (q_rows, k_rows) = p.storage_rows();
    let (q_batches, k_batches) = p.storage_batches();
    let (q_guard, k_guard, v_guard) = (
        q.device_ptr(&stream),
        k.device_ptr(&stream),
        v.device_ptr(&stream),
    );
    let mut scratch: Vec<CudaSlice<T>> = Vec::new();
    let mut operand = |base: u64,
                       s: Strides,
                       batch: usize,
                       rows: usize,
                       heads: usize,
                       packed: bool|
     -> Result<Operand> {
        if !packed {
            return Ok(Operand {
                ptr: base + (s.offset * esize) as u64,
                s,
            });
        }
        let (buf, s) = pack::<T>(dev, &stream, base, s, batch, rows, heads, d, plan.d_load)?;
        // The guard only orders other streams; `scratch` keeps the buffer alive past the
        // launch.
        let ptr = buf.device_ptr(&stream).0;
        scratch.push(buf);
        Ok(Operand { ptr, s })
    };
    let qo = operand(q_guard.0, p.q, q_batches, q_rows, p.heads, plan.pack[0])?;
    let ko = operand(k_guard.0, p.k, k_batches, k_rows, p.kv_heads, plan.pack[1])?;
    let vo = operand(v_guard.0, p.v, k_batches, k_rows, p.kv_heads, plan.pack[2])?;

    let out_len = p.total_q * p.heads * d;
    // SAFETY: every element of `out` and `lse` is written by the kernel before anyone reads it
    // (each (row, head, column block) belongs to exactly one block, which stores all its columns
    // and, for the first column block, the lse).
    let mut out = unsafe { dev.alloc::<T>(out_len)? };
    // SAFETY: as above.
    let mut lse = unsafe { dev.alloc::<f32>(p.total_q * p.heads)? };

    // Lengths, block table and prefix ranges: the caller's device tensors where validation left
    // them on the GPU (no host round trip), else uploads of the host copies. Host query lengths
    // that are all `max_seqlen_q` (every KV-cache call) are not uploaded: the kernels find
    // sequence b at row b * seq_q (`q_uniform`), so a decode step allocates nothing but its
    // output and split scratch.
    let q_uniform = p.varlen.as_ref().is_some_and(|vl| {
        vl.device.is_none()
            && vl
                .cu_q
                .iter()
                .enumerate()
                .all(|(b, &c)| c as usize == b * vl.max_seqlen_q)
    });
    let cu = match &p.varlen {
        None => None,
        Some(vl) => Some(match &vl.device {
            Some(d) => (
                Some(DevInts::Tensor(d.cu_q.clone())),
                DevInts::Tensor(d.cu_k.clone()),
            ),
            // KV-cache calls take their key counts from `seqused_k`; `cu_k` is not read.
            None => (
                match q_uniform {
                    true => None,
                    false => Some(DevInts::Host(stream.clone_htod(&vl.cu_q).w()?)),
                },
                match &p.seqused_k {
                    Some((t, _)) => DevInts::Tensor(t.clone()),
                    None => DevInts::Host(stream.clone_htod(&vl.cu_k).w()?),
                },
            ),
        }),
    };
    // A contiguous KV cache (one block per sequence, in order: the table forward_kvcache builds)
    // is read without a table: with key counts from `seqused_k`, the kernels address row j of
    // sequence b as block b, row j, the same element.
    let identity = |pg: &Paged| {
        p.seqused_k.is_some()
            && pg.device_table.is_none()
            && pg.max_blocks == 1
            && pg.num_blocks == p.batch
            && pg.table.iter().enumerate().all(|(b, &t)| t as usize == b)
    };
    let table = match p.paged.as_ref().filter(|pg| !identity(pg)) {
        None => None,
        Some(pg) => Some(match &pg.device_table {
            Some(t) => DevInts::Tensor(t.clone()),
            None => DevInts::Host(stream.clone_htod(&pg.table).w()?),
        }),
    };
    let prefix = match &p.prefix {
        None => None,
        Some(pr) => Some(match &pr.device {
            Some(t) => DevInts::Tensor(t.clone()),
            None => {
                let flat: Vec<u32> = pr
                    .ranges
                    .iter()
                    .flat_map(|r| {
                        r.map(|x| x.clamp(i32::MIN as i64, i32::MAX as i64) as i32 as u32)
                    })
                    .collect();
                DevInts::Host(stream.clone_htod(&flat).w()?)
            }
        }),
    };
    let cu_ptrs = match &cu {
        None => (0, 0),
        Some((a, b)) => (
            a.as_ref().map_or(Ok(0), |a| a.ptr(&stream))?,
            b.ptr(&stream)?,
        ),
    };
    let table_ptr = table.as_ref().map_or(Ok(0), |t| t.ptr(&stream))?;
    let prefix_ptr = prefix.as_ref().map_or(Ok(0), |t| t.ptr(&stream))?;
    let alibi = match alibi {
        None => None,
        Some(a) => Some(a.to_dtype(DType::F32)?.contiguous()?),
    };
    let alibi_storage = alibi.as_ref().map(|a| a.storage_and_layout());
    let alibi_slice = match &alibi_storage {
        None => None,
        Some((st, l)) => match &**st {
            Storage::Cuda(c) => Some((c.as_cuda_slice::<f32>()?, l.start_offset())),
            _ => bail!("flash-attn: alibi_slopes must be on the same CUDA device as q"),
        },
    };

    // Split-KV decode: f32 partial outputs and base-2 log-sum-exps of every split.
    let split = plan.decode.as_ref().filter(|s| s.splits > 1);
    let parts = match split {
        None => None,
        Some(s) => {
            // SAFETY: every partial of every (split, row, head) is written by the partial pass
            // before the combine pass reads it (blocks of a split with no key write zeros and
            // -inf).
            let o = unsafe { dev.alloc::<f32>(s.splits * p.total_q * p.heads * d)? };
            // SAFETY: as above.
            let l = unsafe { dev.alloc::<f32>(s.splits * p.heads * p.total_q)? };
            Some((o, l))
        }
    };
    let part_guards = parts
        .as_ref()
        .map(|(o, l)| (o.device_ptr(&stream), l.device_ptr(&stream)));
    let (o_guard, lse_guard) = (out.device_ptr_mut(&stream), lse.device_ptr_mut(&stream));
    let alibi_guard = alibi_slice.map(|(s, off)| (s.device_ptr(&stream), off));

    let seq_k = p
        .paged
        .as_ref()
        .map_or(p.max_seq_k, |pg| p.max_seq_k.min(pg.max_blocks * pg.page));
    let params = Params {
        q: qo.ptr,
        k: ko.ptr,
        v: vo.ptr,
        o: o_guard.0,
        lse: lse_guard.0,
        alibi: alibi_guard
            .as_ref()
            .map_or(0, |(g, off)| g.0 + (*off * 4) as u64),
        cu_q: cu_ptrs.0,
        cu_k: cu_ptrs.1,
        o_part: part_guards.as_ref().map_or(0, |(o, _)| o.0),
        lse_part: part_guards.as_ref().map_or(0, |(_, l)| l.0),
        block_table: table_ptr,
        seqused_k: match &p.seqused_k {
            Some((t, _)) => super::append::int_ptr(t, &stream)?,
            None => 0,
        },
        prefix: prefix_ptr,
        dv_splits: to_i32(plan.dv_splits, "dv splits")?,
        num_splits: plan.decode.as_ref().map_or(1, |s| s.splits) as i32,
        split_keys: to_i32(
            plan.decode.as_ref().map_or(0, |s| s.split_keys),
            "split keys",
        )?,
        m_tiles: plan.decode.as_ref().map_or(1, |s| s.m_tiles) as i32,
        page: to_i32(p.paged.as_ref().map_or(0, |pg| pg.page), "page_block_size")?,
        max_blocks: to_i32(p.paged.as_ref().map_or(0, |pg| pg.max_blocks), "max_blocks")?,
        num_blocks: to_i32(p.paged.as_ref().map_or(0, |pg| pg.num_blocks), "num_blocks")?,
        k_add: to_i32(p.seqused_k.as_ref().map_or(0, |(_, n)| *n), "seq_new")?,
        max_ranges: to_i32(
            p.prefix.as_ref().map_or(0, |pr| pr.max_ranges),
            "max_ranges",
        )?,
        page_shift: p
            .paged
            .as_ref()
            .filter(|pg| pg.page.is_power_of_two())
            .map_or(-1, |pg| pg.page.trailing_zeros() as i32),
        q_uniform: q_uniform as i32,
        ..problem_params(p, [&qo.s, &ko.s, &vo.s], plan.d_load, seq_k)?
    };
    if let Kernel::Sm90(i) = plan.kernel {
        let bf16 = T::DTYPE == DType::BF16;
        // Varlen operands are one packed run of rows (batch 1); the kernel then addresses rows
        // from cu_q / cu_k.
        let map = |o: &Operand, heads: usize, rows: usize, batches: usize, box_rows: usize| {
            tma_map(
                o.ptr,
                &o.s,
                esize,
                bf16,
                [plan.d_load, heads, rows, batches],
                box_rows,
            )
        };
        let maps = [
            map(&qo, p.heads, q_rows, q_batches, i.rows())?,
            map(&ko, p.kv_heads, k_rows, k_batches, i.bn)?,
            map(&vo, p.kv_heads, k_rows, k_batches, i.bn)?,
        ];
        // Persistent instances store the output (contiguous (total_q, heads, d)) through a
        // map of 64-row boxes: per batch where every sequence holds seq_q rows (rows past it
        // are clipped), else as one packed run (whole boxes only; see O_STORE_* in
        // kernels/sm90/fwd.cuh). The map's rows need 16-byte strides: other widths are stored
        // by the threads.
        let packed_q = p.varlen.is_some() && !q_uniform;
        let bulk = i.persistent && d.is_multiple_of(8) && p.total_q > 0 && !o.thread_stores;
        let (o_map, o_mode) = if bulk {
            let (rows, batches) = match packed_q {
                true => (p.total_q, 1),
                false => (p.max_seq_q, p.batch),
            };
            let s = Strides {
                offset: 0,
                batch: rows * p.heads * d,
                seq: p.heads * d,
                head: d,
                dim: 1,
            };
            let o_map = tma_map(o_guard.0, &s, esize, bf16, [d, p.heads, rows, batches], 64)?;
            let mode = match packed_q {
                true => O_STORE_TMA_PACKED,
                false => O_STORE_TMA,
            };
            (o_map, mode)
        } else {
            (TmaMap([0; 16]), O_STORE_THREADS)
        };
        // The persistent scheduler's tile counter, zeroed on the stream for this call.
        let counter = match i.persistent {
            true => Some(dev.alloc_zeros::<i32>(1)?),
            false => None,
        };
        let counter_guard = counter.as_ref().map(|c| c.device_ptr(&stream));
        let group = sm90_tile_group(p, plan.d_load, SM90_L2_KV_BYTES) as i32;
        let args = Sm90Args(
            params,
            maps,
            o_map,
            o_mode,
            counter_guard.as_ref().map_or(0, |g| g.0),
            group,
        );
        launch_args::<Params>(
            dev,
            plan.module,
            &plan.function,
            plan.grid,
            plan.threads,
            plan.smem,
            Args::Sm90(&args),
        )?;
        drop(counter_guard);
    } else {
        launch_function(
            dev,
            plan.module,
            &plan.function,
            plan.grid,
            plan.threads,
            plan.smem,
            &params,
        )?;
    }
    if let Some(combine) = split.and_then(|s| s.combine.as_deref()) {
        let cfg = LaunchConfig {
            grid_dim: (p.total_q as u32, p.heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (module, text) = ptx(plan.module);
        let func = dev.get_or_load_custom_func(combine, module, text)?;
        let mut builder = func.builder();
        builder.arg(&params);
        // SAFETY: as for the partial pass; the combine kernel reads the partials the partial
        // pass wrote on the same stream and writes each (row, head) of out and lse once.
        unsafe { builder.launch(cfg) }.w()?;
    }
    drop(part_guards);
    drop(parts);
    drop((o_guard, lse_guard, alibi_guard, q_guard, k_guard, v_guard));
    drop(scratch);
    drop((cu, table, prefix));

    let out = CudaStorage::wrap_cuda_slice(out, dev.clone());
    let lse = CudaStorage::wrap_cuda_slice(lse, dev.clone());
    Ok((out, lse))
}

/// How the sm_90a forward's epilogue writes O (`o_mode`; `O_STORE_*` in kernels/sm90/fwd.cuh):
/// by the threads, by bulk tensor stores through a dense (column, head, row, batch) map, or
/// through a map of packed varlen rows.
const O_STORE_THREADS: i32 = 0;
const O_STORE_TMA: i32 = 1;
const O_STORE_TMA_PACKED: i32 = 2;

/// The sm_90a kernels' parameters: the parameter struct, the tensor maps of q, k and v, the
/// output's map and how the epilogue stores through it (`O_STORE_*` in kernels/sm90/fwd.cuh),
/// the persistent scheduler's zeroed tile counter (0 for the other instances) and its group of
/// (batch, head) pairs.
struct Sm90Args(Params, [TmaMap; 3], TmaMap, i32, u64, i32);

impl Sm90Args {
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        b.arg(&self.0)
            .arg(&self.1[0])
            .arg(&self.1[1])
            .arg(&self.1[2])
            .arg(&self.2)
            .arg(&self.3)
            .arg(&self.4)
            .arg(&self.5);
    }
}

/// Loads `function` from `module`, opts into its `smem` bytes of dynamic shared memory and
/// launches it with its parameter struct: every forward and backward kernel goes through here
/// or [`launch_with_maps`].
pub(crate) fn launch_function<P: DeviceRepr>(
    dev: &CudaDevice,
    module: Module,
    function: &str,
    grid: (u32, u32, u32),
    threads: u32,
    smem: usize,
    params: &P,
) -> Result<()> {
    launch_with_maps(dev, module, function, grid, threads, smem, params, &[])
}

/// As [`launch_function`], the parameter struct followed by tensor maps (`__grid_constant__`
/// parameters): the sm_90a backward kernels.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_with_maps<P: DeviceRepr>(
    dev: &CudaDevice,
    module: Module,
    function: &str,
    grid: (u32, u32, u32),
    threads: u32,
    smem: usize,
    params: &P,
    maps: &[TmaMap],
) -> Result<()> {
    launch_args(
        dev,
        module,
        function,
        grid,
        threads,
        smem,
        Args::Maps(params, maps),
    )
}

/// What a launch pushes: the sm_90a forward kernels' parameters, or a parameter struct and
/// tensor maps (none for most kernels).
enum Args<'p, P: DeviceRepr> {
    Sm90(&'p Sm90Args),
    Maps(&'p P, &'p [TmaMap]),
}

fn launch_args<P: DeviceRepr>(
    dev: &CudaDevice,
    module: Module,
    function: &str,
    grid: (u32, u32, u32),
    threads: u32,
    smem: usize,
    args: Args<'_, P>,
) -> Result<()> {
    let (module, text) = ptx(module);
    let func = dev.get_or_load_custom_func(function, module, text)?;
    // The plan left room for the kernels' few bytes of static shared memory; make sure it did.
    let static_smem = func
        .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
        .w()? as usize;
    if static_smem > STATIC_SMEM_RESERVE {
        bail!(
            "flash-attn: kernel {function} holds {static_smem} bytes of static shared memory, \
             more than the {STATIC_SMEM_RESERVE} its plan reserves"
        )
    }
    if smem + static_smem > 48 * 1024 {
        // Above 48 KB per block, dynamic shared memory must be opted into per function.
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .w()?;
    }
    let cfg = LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let mut builder = func.builder();
    match args {
        Args::Sm90(a) => a.push(&mut builder),
        Args::Maps(p, maps) => {
            builder.arg(p);
            for m in maps {
                builder.arg(m);
            }
        }
    }
    // SAFETY: the pushed arguments match the kernel's parameters (the parameter structs are
    // checked at build time, the tensor maps are the driver's 128-byte CUtensorMap); the caller
    // keeps every pointer in them alive until after the launch, and `check_bounds` plus the
    // kernels' clamped per-sequence lengths bound every element read or written; the grid and
    // shared memory fit the device limits the plan was made for.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}

/// 4-byte integers the kernels read: a caller's tensor on the GPU, or an upload of a host copy.
enum DevInts {
    Tensor(Tensor),
    Host(CudaSlice<u32>),
}

impl DevInts {
    /// The device address of the first element; the storage stays alive with `self`.
    fn ptr(&self, stream: &std::sync::Arc<CudaStream>) -> Result<u64> {
        match self {
            DevInts::Host(s) => Ok(s.device_ptr(stream).0),
            DevInts::Tensor(t) => super::append::int_ptr(t, stream),
        }
    }
}

fn to_i32(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x)
        .map_err(|_| candle::Error::Msg(format!("flash-attn: {what} = {x} exceeds i32")))
}

/// Copies a strided 16-bit operand into a contiguous `(batch, rows, heads, dp)` buffer with
/// zero padding columns; returns it with its strides.
#[allow(clippy::too_many_arguments)]
fn pack<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    stream: &std::sync::Arc<CudaStream>,
    base: u64,
    s: Strides,
    batch: usize,
    rows: usize,
    heads: usize,
    d: usize,
    dp: usize,
) -> Result<(CudaSlice<T>, Strides)> {
    let len = batch * rows * heads * dp;
    // SAFETY: the pack kernel writes every one of the `len` elements (padding included).
    let mut dst = unsafe { dev.alloc::<T>(len.max(1))? };
    if len > 0 {
        let func = dev.get_or_load_custom_func("pack_b16", PACK_PTX.0, PACK_PTX.1)?;
        let (dst_ptr, dst_guard) = dst.device_ptr_mut(stream);
        let src = base + (s.offset * 2) as u64;
        let args: [i64; 9] = [
            batch as i64,
            rows as i64,
            heads as i64,
            d as i64,
            dp as i64,
            s.batch as i64,
            s.seq as i64,
            s.head as i64,
            s.dim as i64,
        ];
        let threads = 256usize;
        let blocks = len.div_ceil(threads).min(65535 * 8);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&src).arg(&dst_ptr);
        for a in &args {
            b.arg(a);
        }
        // SAFETY: the kernel reads elements of the source view, all inside its storage
        // (`check_bounds` ran on it), and writes `len` elements of `dst`; argument types match
        // `pack_b16` (two pointers, nine int64).
        unsafe { b.launch(cfg) }.w()?;
        drop(dst_guard);
    }
    let strides = Strides {
        offset: 0,
        batch: rows * heads * dp,
        seq: heads * dp,
        head: dp,
        dim: 1,
    };
    Ok((dst, strides))
}
