//! What every CUDA pass needs to execute a plan on candle's stream: the device's capabilities,
//! the embedded PTX modules, one launch helper, tensor maps, device-resident integer arguments,
//! packed operand copies, and the bias and block mask as the kernels read them. Nothing here
//! decides anything: plans do.

pub(crate) mod call;
pub(crate) mod extras;
pub(crate) mod ints;
pub(crate) mod operands;
pub(crate) mod tma;

use candle::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle::cuda_backend::cudarc::driver::{
    CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle::cuda_backend::{CudaDevice, WrapErr};
use candle::{bail, Result};

use super::device::{DeviceCaps, STATIC_SMEM_RESERVE};
use super::launch::{Launch, Module};
use super::params::BwdParams;
use super::params::Params;
use tma::TmaMap;

// SAFETY: `Params` is `#[repr(C)]`, `Copy`, made of plain integers and floats, and its C twin
// `FlashParams` is checked field by field at build time (see params.rs).
unsafe impl DeviceRepr for Params {}
// SAFETY: as `Params` (the backward's C twin `BwdParams` is checked the same way).
unsafe impl DeviceRepr for BwdParams {}

/// candle's cache name and the PTX text of a module.
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
        Module::DecodeBf16 => (
            "candle_flash_decode_bf16",
            include_str!(concat!(env!("OUT_DIR"), "/flash_decode_bf16.ptx")),
        ),
        Module::DecodeF16 => (
            "candle_flash_decode_f16",
            include_str!(concat!(env!("OUT_DIR"), "/flash_decode_f16.ptx")),
        ),
        Module::DecodeSm90 => (
            "candle_flash_decode_sm90",
            include_str!(concat!(env!("OUT_DIR"), "/flash_decode_sm90.ptx")),
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
        Module::DecodeFp8 => (
            "candle_flash_decode_fp8",
            include_str!(concat!(env!("OUT_DIR"), "/flash_decode_fp8.ptx")),
        ),
        Module::DecodeFp8Portable => (
            "candle_flash_decode_fp8_sm80",
            include_str!(concat!(env!("OUT_DIR"), "/flash_decode_fp8_sm80.ptx")),
        ),
        Module::Pack => (
            "candle_flash_pack",
            include_str!(concat!(env!("OUT_DIR"), "/pack.ptx")),
        ),
        Module::Merge => (
            "candle_flash_merge",
            include_str!(concat!(env!("OUT_DIR"), "/merge.ptx")),
        ),
        Module::Tiles => (
            "candle_flash_tiles",
            include_str!(concat!(env!("OUT_DIR"), "/tiles.ptx")),
        ),
    }
}

/// Whether module `m`'s PTX defines the kernel entry point `function`: the planners' tests
/// check every launch they plan against it, so that a name no module defines fails without a
/// GPU.
#[cfg(test)]
pub(crate) fn defines(m: Module, function: &str) -> bool {
    ptx(m).1.contains(&format!(".entry {function}("))
}

/// What the planners need, read from the device once per process and device: some attributes
/// (the memory clock among them) cost the driver hundreds of microseconds, more than a decode
/// step. `portable` (the caller's option, or `CANDLE_FLASH_PORTABLE=1` in the environment) turns
/// the sm_90a kernels off.
pub(crate) fn caps(stream: &CudaStream, portable: bool) -> Result<DeviceCaps> {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static CACHE: Mutex<Option<HashMap<usize, DeviceCaps>>> = Mutex::new(None);
    let ctx = stream.context();
    let ordinal = ctx.ordinal();
    let cached = CACHE
        .lock()
        .ok()
        .and_then(|c| c.as_ref()?.get(&ordinal).copied());
    let caps = match cached {
        Some(c) => c,
        None => {
            let c = read_caps(stream)?;
            if let Ok(mut cache) = CACHE.lock() {
                cache.get_or_insert_with(HashMap::new).insert(ordinal, c);
            }
            c
        }
    };
    Ok(if portable || portable_from_env() {
        caps.portable()
    } else {
        caps
    })
}

fn read_caps(stream: &CudaStream) -> Result<DeviceCaps> {
    let ctx = stream.context();
    let attr = |a| -> Result<usize> { Ok(ctx.attribute(a).w()?.max(0) as usize) };
    use CUdevice_attribute as A;
    let (major, minor) = (
        attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32,
        attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32,
    );
    // kHz x bits: two transfers per clock (DDR, HBM), eight bits a byte.
    let mem_khz = attr(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)?;
    let bus_bits = attr(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)?;
    Ok(DeviceCaps {
        major,
        minor,
        sms: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
        smem_optin: attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
        dram_bytes_per_us: mem_khz * bus_bits * 2 / 8 / 1000,
        l2_bytes: attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
        hopper: major == 9 && minor == 0,
        fp8: major > 8 || (major == 8 && minor >= 9),
    })
}

/// `CANDLE_FLASH_PORTABLE=1` (read once): the documented process-wide form of
/// [`FlashAttn::portable`](crate::FlashAttn::portable).
fn portable_from_env() -> bool {
    static PORTABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PORTABLE.get_or_init(|| {
        std::env::var("CANDLE_FLASH_PORTABLE").is_ok_and(|v| !v.is_empty() && v != "0")
    })
}

/// How many blocks of `l` one SM of `dev` holds at once: the driver's occupancy of the compiled
/// kernel (its registers and static shared memory) at `l`'s block size and dynamic shared
/// memory. Cached per device and entry point: it depends on the code and the GPU only.
pub(crate) fn residency(dev: &CudaDevice, l: &Launch) -> Result<usize> {
    use std::collections::HashMap;
    use std::sync::Mutex;
    type Key = (candle::cuda_backend::DeviceId, usize);
    static CACHE: Mutex<Option<HashMap<Key, HashMap<String, usize>>>> = Mutex::new(None);
    let key = (dev.id(), l.smem);
    let cached = |c: &Mutex<Option<HashMap<Key, HashMap<String, usize>>>>| -> Option<usize> {
        c.lock()
            .ok()?
            .as_ref()?
            .get(&key)?
            .get(l.function.as_str())
            .copied()
    };
    if let Some(n) = cached(&CACHE) {
        return Ok(n);
    }
    let func = function(dev, l)?;
    let n = func
        .occupancy_max_active_blocks_per_multiprocessor(l.threads, l.smem, None)
        .w()? as usize;
    if let Ok(mut c) = CACHE.lock() {
        let by_name = c.get_or_insert_with(HashMap::new).entry(key).or_default();
        by_name.insert(l.function.clone(), n);
    }
    Ok(n)
}

/// The loaded entry point of `l`, opted into `l`'s dynamic shared memory, after checking that
/// a plan that sizes dynamic shared memory left room for the kernel's static shared memory.
/// Kept per device and entry point with the dynamic shared memory it was opted into: loading a
/// function and reading and setting its attributes are driver calls of about a microsecond each,
/// which a decode step of a few microseconds would otherwise pay on every launch.
fn function(dev: &CudaDevice, l: &Launch) -> Result<CudaFunction> {
    use std::collections::HashMap;
    use std::sync::Mutex;
    struct Loaded {
        func: CudaFunction,
        static_smem: usize,
        /// The dynamic shared memory the function is opted into (0: the default 48 KB).
        opted: usize,
    }
    type Functions = HashMap<candle::cuda_backend::DeviceId, HashMap<String, Loaded>>;
    static CACHE: Mutex<Option<Functions>> = Mutex::new(None);
    let mut guard = CACHE
        .lock()
        .map_err(|_| candle::Error::Msg("flash-attn: the kernel cache is poisoned".into()))?;
    let by_name = guard
        .get_or_insert_with(HashMap::new)
        .entry(dev.id())
        .or_default();
    if !by_name.contains_key(l.function.as_str()) {
        let (module, text) = ptx(l.module);
        let func = dev
            .get_or_load_custom_func(&l.function, module, text)?
            .into_cuda_function();
        let static_smem = func
            .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            .w()? as usize;
        let loaded = Loaded {
            func,
            static_smem,
            opted: 0,
        };
        by_name.insert(l.function.clone(), loaded);
    }
    let Some(f) = by_name.get_mut(l.function.as_str()) else {
        bail!("flash-attn: kernel {} was not loaded", l.function)
    };
    // (Kernels without dynamic shared memory need no room.)
    if l.smem > 0 && f.static_smem > STATIC_SMEM_RESERVE {
        bail!(
            "flash-attn: kernel {} holds {} bytes of static shared memory, more than \
             the {STATIC_SMEM_RESERVE} its plan reserves",
            l.function,
            f.static_smem
        )
    }
    if l.smem + f.static_smem > 48 * 1024 && l.smem > f.opted {
        // Above 48 KB per block, dynamic shared memory must be opted into per function.
        f.func
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                l.smem as i32,
            )
            .w()?;
        f.opted = l.smem;
    }
    Ok(f.func.clone())
}

/// One kernel argument, pushed by value in order.
pub(crate) enum Arg<'a> {
    Params(&'a Params),
    Bwd(&'a BwdParams),
    Map(&'a TmaMap),
    I32(&'a i32),
    I64(&'a i64),
    Ptr(&'a u64),
}

/// Loads the plan's function and launches it on candle's stream with `args`. An empty grid
/// launches nothing.
pub(crate) fn launch(dev: &CudaDevice, l: &Launch, args: &[Arg]) -> Result<()> {
    if l.is_empty() {
        return Ok(());
    }
    let func = function(dev, l)?;
    let cfg = LaunchConfig {
        grid_dim: l.grid,
        block_dim: (l.threads, 1, 1),
        shared_mem_bytes: l.smem as u32,
    };
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    for a in args {
        match a {
            Arg::Params(p) => builder.arg(*p),
            Arg::Bwd(p) => builder.arg(*p),
            Arg::Map(m) => builder.arg(*m),
            Arg::I32(x) => builder.arg(*x),
            Arg::I64(x) => builder.arg(*x),
            Arg::Ptr(x) => builder.arg(*x),
        };
    }
    // SAFETY: the arguments match the kernel's parameters (the parameter structs are checked
    // at build time, the tensor maps are the driver's 128-byte CUtensorMap, the rest are the
    // scalar types the entry point declares); the callers keep every pointer in them alive
    // until after the launch, and `check_bounds` plus the kernels' clamped per-sequence lengths
    // bound every element read or written; the grid and shared memory fit the device limits
    // the plan was made for.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}
