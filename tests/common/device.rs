//! Where a test body runs, and the runners behind `test_device!` / `test_cuda!`.
//!
//! A body gets a [`Target`]: a device and one kernel configuration. On the CPU there is one
//! configuration. On a CUDA GPU the same body runs once per configuration of its [`Suite`],
//! so that the kernels a planner would not pick for these shapes on this GPU are tested too:
//!
//! | name              | what it forces                                     | where           |
//! |-------------------|----------------------------------------------------|-----------------|
//! | `default`         | nothing: the planner's choice                      | every GPU       |
//! | `portable`        | `FlashAttn::portable(true)`: the compute-8.0 kernels | Hopper        |
//! | `sm90-persistent` | the persistent sm_90a forward (`wg2p`) on 3 blocks, so each block takes many tiles | Hopper |
//! | `decode-1-split`  | split-KV decode without splitting (no combine)     | every GPU       |
//! | `decode-max-splits` | split-KV decode with one key tile per split      | every GPU       |
//! | `bwd-...`         | the non-default sm_90a backward instances, named by `PlanOverride::bwd_sm90_variants` (see [`bwd_variant_sets`]) | Hopper |
//!
//! Suites: `Forward` (default, portable, sm90-persistent), `Decode` (default, portable, the two
//! decode splits; also paged caches, which the decode kernels read), `Backward` (default,
//! portable, one `bwd-...` configuration per set of [`bwd_variant_sets`]) and `Once` (default
//! only: validation and refusals, which launch nothing). "Hopper" means compute capability 9.0
//! with the sm_90a kernels allowed (not `CANDLE_FLASH_PORTABLE=1`); elsewhere the portable
//! kernels are the default ones. A failure names its configuration.
//!
//! Bodies reach the configuration through [`Target::op`]: every call of the op under test goes
//! through it, which also moves the options' tensors (ALiBi slopes, block table, prefix ranges)
//! to the device.
//!
//! # Environment (tests only: the library reads none of these)
//!
//! * `CANDLE_FLASH_SKIP_GPU_TESTS=1`: with the `cuda` feature and no usable CUDA device, each
//!   CUDA test prints that it skipped and passes. Without it, no device is a failure: a GPU test
//!   that ran nothing must not read as a pass.
//! * `CANDLE_FLASH_TEST_SMALL=1`: a few small ragged shapes only, for compute-sanitizer (on
//!   CUDA; the CPU tests keep their shapes). The `sanitizer_` tests are the sanitizer subsets;
//!   others shrink where they are large.
//! * `CANDLE_FLASH_TEST_THREAD_STORES=1`: every CUDA configuration sets
//!   `PlanOverride::thread_stores` (the sm_90a output written by the threads, not by the tensor
//!   copy engine, whose writes compute-sanitizer's initcheck does not count).
//! * `CANDLE_FLASH_TEST_CONFIGS=a,b`: only the CUDA configurations named (see the table); a name
//!   that is no configuration is a failure.
//! * `CANDLE_FLASH_TOL_REPORT=1`: every comparison prints its error against the tolerance
//!   (see `compare`).
//! * `CANDLE_FLASH_PORTABLE=1` is the library's own (documented) override: every CUDA call takes
//!   the portable kernels, so only the configurations that apply off Hopper run.
//!
//! Variables the tests or the library once read (`CANDLE_FLASH_GPU_SMALL`,
//! `CANDLE_FLASH_SM90_VARIANT`, `CANDLE_FLASH_BWD_DETERMINISTIC`, ...) fail every test when set,
//! naming what replaced them, so that a stale script cannot run a narrower matrix than it thinks.
//!
//! # Running on a GPU
//!
//! The test targets with GPU tests are the files under `tests/` that use `test_device!` or
//! `test_cuda!`; a script lists them with
//!
//! ```text
//! grep -l -E 'test_(device|cuda)!' tests/*.rs | xargs -n1 basename -s .rs
//! ```
//!
//! and builds each with `cargo test --release --features cuda,candle-nn/cuda --test NAME
//! --no-run`. In a binary, `-- ::cuda` runs the GPU tests only (`--skip ::cpu` likewise); the
//! subsets for compute-sanitizer are the tests named `sanitizer_` (forward, decode, backward),
//! run with `CANDLE_FLASH_TEST_SMALL=1 ... -- sanitizer_ --skip ::cpu`; memcheck also covers the
//! paged caches with `-- paged_ kvcache --skip ::cpu` (paged), and initcheck wants
//! `CANDLE_FLASH_TEST_THREAD_STORES=1`. CUDA tests of one binary run one at a time whatever
//! `--test-threads` says.

use candle::{Device, Result, Tensor};
use candle_flash::{BlockMask, FlashAttn, PlanOverride};

use super::bwd_instances::{Sm90Bwd, BWD_SM90};

/// Set to `1`: no CUDA device is an explicit skip instead of a failure.
pub const SKIP_GPU_TESTS: &str = "CANDLE_FLASH_SKIP_GPU_TESTS";
/// Set to `1`: small shapes for compute-sanitizer.
pub const SMALL: &str = "CANDLE_FLASH_TEST_SMALL";
/// Set to `1`: `PlanOverride::thread_stores` in every CUDA configuration.
pub const THREAD_STORES: &str = "CANDLE_FLASH_TEST_THREAD_STORES";
/// Comma-separated configuration names: run only those.
pub const CONFIGS: &str = "CANDLE_FLASH_TEST_CONFIGS";

/// Variables that no longer do anything, and what replaced them.
const STALE: [(&str, &str); 9] = [
    ("CANDLE_FLASH_GPU_SMALL", "CANDLE_FLASH_TEST_SMALL=1"),
    (
        "CANDLE_FLASH_SM90_THREAD_STORES",
        "CANDLE_FLASH_TEST_THREAD_STORES=1",
    ),
    (
        "CANDLE_FLASH_TEST_DEVICE",
        "the `::cuda` tests, built with --features cuda",
    ),
    (
        "CANDLE_FLASH_SM90_VARIANT",
        "the sm90-persistent configuration (CANDLE_FLASH_TEST_CONFIGS)",
    ),
    (
        "CANDLE_FLASH_BWD_SM90_VARIANT",
        "the bwd-... configurations (CANDLE_FLASH_TEST_CONFIGS)",
    ),
    (
        "CANDLE_FLASH_BWD_DETERMINISTIC",
        "nothing: every backward is deterministic",
    ),
    (
        "CANDLE_FLASH_DECODE_WAVES",
        "the decode-... configurations (CANDLE_FLASH_TEST_CONFIGS)",
    ),
    (
        "CANDLE_FLASH_DECODE_STAGES",
        "the decode-... configurations (CANDLE_FLASH_TEST_CONFIGS)",
    ),
    (
        "CANDLE_FLASH_SM90_L2_KV_MIB",
        "nothing (PlanOverride has no such field)",
    ),
];

fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

fn refuse_stale_variables() {
    for (old, new) in STALE {
        if std::env::var_os(old).is_some() {
            panic!(
                "{old} is set, but nothing reads it any more: use {new} (tests/common/device.rs)"
            );
        }
    }
}

/// One kernel configuration of the test matrix (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Config {
    Cpu,
    Default,
    Portable,
    Sm90Persistent,
    DecodeSplits(usize),
    /// One decode instance by name (`PlanOverride::decode_instance`); no suite runs it, the
    /// decode tests that visit every instance build it.
    DecodeInstance(String),
    BwdVariants(Vec<&'static str>),
}

impl Config {
    pub fn name(&self) -> String {
        match self {
            Config::Cpu => "cpu".into(),
            Config::Default => "default".into(),
            Config::Portable => "portable".into(),
            Config::Sm90Persistent => "sm90-persistent".into(),
            Config::DecodeSplits(1) => "decode-1-split".into(),
            Config::DecodeSplits(_) => "decode-max-splits".into(),
            Config::DecodeInstance(n) => format!("decode-{n}"),
            Config::BwdVariants(v) => format!("bwd-{}", v.join("-")),
        }
    }

    /// The plan override this configuration sets, `None` for none.
    fn plan_override(&self) -> Option<PlanOverride> {
        let mut o = match self {
            Config::Cpu => return None,
            Config::Default | Config::Portable => PlanOverride::default(),
            // Three blocks: each one takes many tiles (the scheduler's loop, the second Q
            // buffer, tiles without keys between tiles with keys).
            Config::Sm90Persistent => PlanOverride {
                sm90_variant: Some("wg2p".into()),
                persistent_blocks: Some(3),
                ..PlanOverride::default()
            },
            Config::DecodeSplits(n) => PlanOverride {
                decode_splits: Some(*n),
                ..PlanOverride::default()
            },
            Config::DecodeInstance(n) => PlanOverride {
                decode_instance: Some(n.clone()),
                ..PlanOverride::default()
            },
            Config::BwdVariants(v) => PlanOverride {
                bwd_sm90_variants: v.iter().map(|s| s.to_string()).collect(),
                ..PlanOverride::default()
            },
        };
        o.thread_stores = flag(THREAD_STORES);
        (o != PlanOverride::default()).then_some(o)
    }
}

/// Which configurations a CUDA test runs (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Suite {
    Forward,
    Decode,
    Backward,
    Once,
}

/// The configurations of `suite` on a GPU, Hopper (sm_90a kernels allowed) or not.
pub fn configs(suite: Suite, hopper: bool) -> Vec<Config> {
    let mut v = vec![Config::Default];
    match suite {
        Suite::Once => {}
        Suite::Forward => {
            if hopper {
                v.extend([Config::Portable, Config::Sm90Persistent]);
            }
        }
        Suite::Decode => {
            if hopper {
                v.push(Config::Portable);
            }
            v.extend([Config::DecodeSplits(1), Config::DecodeSplits(usize::MAX)]);
        }
        Suite::Backward => {
            if hopper {
                v.push(Config::Portable);
                v.extend(bwd_variant_sets().into_iter().map(Config::BwdVariants));
            }
        }
    }
    v
}

/// Every configuration name a GPU may run, for checking `CANDLE_FLASH_TEST_CONFIGS`.
fn all_config_names() -> Vec<String> {
    [Suite::Forward, Suite::Decode, Suite::Backward, Suite::Once]
        .iter()
        .flat_map(|&s| configs(s, true))
        .map(|c| c.name())
        .collect()
}

/// Lists of `PlanOverride::bwd_sm90_variants` names that together make the backward planner pick
/// every named (non-default) instance of `BWD_SM90` at least once. The planner takes, per kernel
/// (dK/dV or dQ) and head dim, the first instance of the table whose name is in the list, so
/// list `i` holds the `i`-th named instance of every such slot: as many lists as the most
/// variants one slot has. [`bwd_variant_pick`] replays the planner's rule and the backward
/// tests check that the lists reach every instance.
pub fn bwd_variant_sets() -> Vec<Vec<&'static str>> {
    let mut slots: Vec<((bool, usize), Vec<&'static str>)> = Vec::new();
    for i in BWD_SM90.iter().filter(|i| !i.variant.is_empty()) {
        let key = (i.dkdv(), i.d);
        match slots.iter_mut().find(|(k, _)| *k == key) {
            Some((_, names)) => names.push(i.variant),
            None => slots.push((key, vec![i.variant])),
        }
    }
    let n = slots
        .iter()
        .map(|(_, names)| names.len())
        .max()
        .unwrap_or(0);
    (0..n)
        .map(|i| {
            let mut set: Vec<&'static str> = Vec::new();
            for (_, names) in &slots {
                if let Some(&name) = names.get(i) {
                    if !set.contains(&name) {
                        set.push(name);
                    }
                }
            }
            set
        })
        .collect()
}

/// The instance the backward planner picks for a kernel (`dkdv` or dQ) at head dim `d`, with or
/// without score modifiers, given the variant names `names` (its rule in
/// `src/cuda/backward/plan.rs`, shared memory aside).
pub fn bwd_variant_pick(dkdv: bool, d: usize, mods: bool, names: &[&str]) -> Option<Sm90Bwd> {
    let fits = |i: &&Sm90Bwd| i.d == d && i.dkdv() == dkdv && (i.mods || !mods);
    BWD_SM90
        .iter()
        .filter(fits)
        .find(|i| names.contains(&i.variant))
        .or_else(|| BWD_SM90.iter().filter(fits).find(|i| i.variant.is_empty()))
        .or_else(|| BWD_SM90.iter().find(fits))
        .copied()
}

/// Where a test body runs: a device and one kernel configuration.
#[derive(Clone, Debug)]
pub struct Target {
    pub dev: Device,
    pub config: Config,
}

impl Target {
    pub fn cpu() -> Self {
        Target {
            dev: Device::Cpu,
            config: Config::Cpu,
        }
    }

    pub fn is_cuda(&self) -> bool {
        self.dev.is_cuda()
    }

    /// The items of a list that selects CUDA kernels (head-dim classes, dtypes, tile-size
    /// lengths) for the `n`-th case of a sweep: every item on a GPU, where each selects other
    /// kernels; on the CPU, whose one kernel serves every head dim and dtype, only item
    /// `n % len`, so that successive cases still visit every item while the f64 references
    /// (which dominate a CPU test's time) are computed once per case, not once per item.
    pub fn sweep<'a, T>(&self, items: &'a [T], n: usize) -> &'a [T] {
        if self.is_cuda() || items.is_empty() {
            return items;
        }
        let i = n % items.len();
        &items[i..i + 1]
    }

    /// `CANDLE_FLASH_TEST_SMALL=1` on a GPU: small shapes for compute-sanitizer.
    pub fn small(&self) -> bool {
        self.is_cuda() && flag(SMALL)
    }

    /// Where a naive yardstick runs: this target, or the host in a compute-sanitizer run
    /// ([`small`](Self::small)), so that only the kernels under test run on the GPU there (the
    /// naive path's cuBLAS products write through the tensor copy engine, which initcheck does
    /// not count as writes).
    pub fn yardstick(&self) -> Target {
        if self.small() {
            Target::cpu()
        } else {
            self.clone()
        }
    }

    /// `opts` for this target: the configuration's choices, and its tensors (ALiBi slopes, block
    /// table, prefix ranges) on the device. Every call of the op under test goes through this.
    pub fn op(&self, opts: &FlashAttn) -> FlashAttn {
        let mut o = opts.clone();
        let put = |t: &Option<Tensor>| t.as_ref().map(|t| to_device(t, &self.dev).unwrap());
        o.alibi_slopes = put(&opts.alibi_slopes);
        o.block_table = put(&opts.block_table);
        o.mm_prefix_ranges = put(&opts.mm_prefix_ranges);
        o.sinks = put(&opts.sinks);
        o.q_descale = put(&opts.q_descale);
        o.k_descale = put(&opts.k_descale);
        o.v_descale = put(&opts.v_descale);
        o.bias = opts.bias.as_ref().map(|b| put_view(b, &self.dev).unwrap());
        o.block_mask = opts.block_mask.as_ref().map(|m| BlockMask {
            mask: put_view(&m.mask, &self.dev).unwrap(),
            ..m.clone()
        });
        if self.config == Config::Portable {
            o = o.portable(true);
        }
        if let Some(p) = self.config.plan_override() {
            o = o.plan_override(p);
        }
        o
    }

    /// `t` on this target's device (tensors without elements too).
    pub fn put(&self, t: &Tensor) -> Result<Tensor> {
        to_device(t, &self.dev)
    }

    /// Leaves 0xFF bytes (NaN in f32, f16 and bf16 alike) behind in the CUDA allocator's pool,
    /// one block of each byte count given, so that the next allocations of those sizes (the op's
    /// outputs) reuse them and an element a kernel fails to write comes back as NaN rather than a
    /// lucky zero. (An f32 NaN pattern would read as +0.0 in every other f16/bf16 element.)
    /// Nothing on the CPU, whose outputs are fresh vectors the kernels fill.
    pub fn poison(&self, bytes: &[usize]) -> Result<()> {
        if !self.is_cuda() {
            return Ok(());
        }
        let blocks = bytes
            .iter()
            .map(|&n| Tensor::full(255u8, n.max(1), &self.dev))
            .collect::<Result<Vec<_>>>()?;
        self.dev.synchronize()?;
        drop(blocks);
        Ok(())
    }
}

/// `t` on `dev` with its broadcast (stride-0) dimensions still broadcast there, so that the
/// kernels see the view the caller built.
fn put_view(t: &Tensor, dev: &Device) -> Result<Tensor> {
    let mut base = t.clone();
    for (dim, &stride) in t.stride().iter().enumerate() {
        if stride == 0 && t.dims()[dim] > 1 {
            base = base.narrow(dim, 0, 1)?;
        }
    }
    to_device(&base, dev)?.broadcast_as(t.dims())
}

/// `t` on `dev`; a tensor without elements becomes an empty view there (CUDA cannot allocate
/// zero bytes).
pub fn to_device(t: &Tensor, dev: &Device) -> Result<Tensor> {
    if t.elem_count() == 0 {
        return super::empty(t.dims(), t.dtype(), dev);
    }
    t.to_device(dev)
}

/// Runs `body` on the CPU (the `::cpu` test of `test_device!`).
pub fn run_cpu(name: &str, body: fn(&Target) -> Result<()>) {
    refuse_stale_variables();
    if let Err(e) = body(&Target::cpu()) {
        panic!("{name} on the CPU: {e}");
    }
}

/// Runs `body` once per configuration of `suite` on the CUDA device (the `::cuda` test), one
/// CUDA test at a time per binary, so that the pool poisoning of one test is not undone by the
/// allocations of another and host references do not compete for the cores.
#[cfg(feature = "cuda")]
pub fn run_cuda(name: &str, suite: Suite, body: fn(&Target) -> Result<()>) {
    refuse_stale_variables();
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let Some(dev) = cuda_device() else { return };
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut run = configs(suite, is_hopper(&dev));
    if let Ok(only) = std::env::var(CONFIGS) {
        let names: Vec<&str> = only.split(',').map(str::trim).collect();
        let known = all_config_names();
        for n in &names {
            assert!(
                known.iter().any(|k| k == n),
                "{CONFIGS} names {n:?}, which is no configuration (known: {known:?})"
            );
        }
        run.retain(|c| names.contains(&c.name().as_str()));
        if run.is_empty() {
            eprintln!("SKIPPED ({CONFIGS}={only}): {name} has no configuration among those");
            return;
        }
    }
    super::reference::with_memo(|| run_configs(name, &dev, run, body))
}

/// The configurations loop of [`run_cuda`].
#[cfg(feature = "cuda")]
fn run_configs(name: &str, dev: &Device, run: Vec<Config>, body: fn(&Target) -> Result<()>) {
    for config in run {
        let what = config.name();
        let t = Target {
            dev: dev.clone(),
            config,
        };
        let started = std::time::Instant::now();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&t))) {
            Ok(Ok(())) => eprintln!(
                "{name}: configuration {what} passed in {:.1} s",
                started.elapsed().as_secs_f64()
            ),
            Ok(Err(e)) => panic!("{name} on CUDA, configuration {what}: {e}"),
            Err(p) => {
                eprintln!("{name} on CUDA FAILED in configuration {what}");
                std::panic::resume_unwind(p)
            }
        }
    }
}

/// The CUDA device of this test binary (one for all its tests: candle tells devices apart by
/// instance, so tensors of two `Device::new_cuda(0)` calls do not mix, and each instance loads
/// the kernel modules again), or `None` after printing that the test skipped, when none answers
/// and `CANDLE_FLASH_SKIP_GPU_TESTS=1` is set. Without that opt-out, no device is a failure.
#[cfg(feature = "cuda")]
pub fn cuda_device() -> Option<Device> {
    static DEVICE: std::sync::OnceLock<std::result::Result<Device, String>> =
        std::sync::OnceLock::new();
    let opened = DEVICE.get_or_init(|| {
        // cudarc panics (rather than erring) when the driver library itself is missing.
        match std::panic::catch_unwind(|| Device::new_cuda(0)) {
            Ok(Ok(d)) => Ok(d),
            // First line only: candle appends a backtrace to device errors.
            Ok(Err(e)) => Err(e.to_string().lines().next().unwrap_or_default().to_string()),
            Err(p) => Err(p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic while opening the device".into())),
        }
    });
    match opened {
        Ok(d) => Some(d.clone()),
        Err(err) if flag(SKIP_GPU_TESTS) => {
            eprintln!("SKIPPED ({SKIP_GPU_TESTS}=1): no CUDA device: {err}");
            None
        }
        Err(err) => panic!(
            "no usable CUDA device ({err}); the GPU tests did not run. \
             Set {SKIP_GPU_TESTS}=1 to skip them explicitly."
        ),
    }
}

/// Compute capability 9.0 with the sm_90a kernels allowed: where `portable`, the sm_90a forward
/// variants and the sm_90a backward instances differ from the default kernels.
#[cfg(feature = "cuda")]
pub fn is_hopper(dev: &Device) -> bool {
    use candle::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    let Device::Cuda(cuda) = dev else {
        return false;
    };
    let stream = cuda.cuda_stream();
    let ctx = stream.context();
    let major = ctx
        .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .expect("compute capability");
    let minor = ctx
        .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        .expect("compute capability");
    // The library's own switch, read the same way (any value but empty or "0").
    let forced = std::env::var("CANDLE_FLASH_PORTABLE").is_ok_and(|v| !v.is_empty() && v != "0");
    (major, minor) == (9, 0) && !forced
}
