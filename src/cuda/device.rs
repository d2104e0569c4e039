//! What the planners know about a GPU: one description for every pass, read once per device by
//! `runtime::caps` and written out for four GPU classes in the unit tests.

/// The limits and rates a plan is derived from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceCaps {
    /// Compute capability.
    pub major: u32,
    pub minor: u32,
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Largest dynamic plus static shared memory one block may opt into, in bytes.
    pub smem_optin: usize,
    /// Shared memory of one SM, in bytes (the blocks resident on it share it).
    pub smem_per_sm: usize,
    /// 32-bit registers of one SM.
    pub regs_per_sm: usize,
    /// Threads one SM holds at once.
    pub threads_per_sm: usize,
    /// Level-2 cache, in bytes.
    pub l2_bytes: usize,
    /// Peak DRAM bandwidth from the memory clock and bus width, in bytes per microsecond.
    pub dram_bytes_per_us: usize,
    /// Run the sm_90a (wgmma + TMA) kernels where they cover the problem: compute capability
    /// 9.0, unless the caller asked for the portable path.
    pub hopper: bool,
}

/// Shared memory the plan keeps free for the kernels' static `__shared__` values (a few
/// block-uniform values); the launch code checks the compiled kernels stay within it.
pub(crate) const STATIC_SMEM_RESERVE: usize = 1024;

/// Shared memory the driver reserves per resident block (sm_80 and later).
const DRIVER_SMEM_PER_BLOCK: usize = 1024;

impl DeviceCaps {
    /// A100 (SXM, 40 GB).
    #[cfg(test)]
    pub const SM80: Self = Self::with(8, 0, 108, 166_912, 40 << 20, 1_555_000);
    /// RTX 3090 class (sm_86).
    #[cfg(test)]
    pub const SM86: Self = Self::with(8, 6, 82, 101_376, 6 << 20, 936_000);
    /// RTX 4090 class (sm_89).
    #[cfg(test)]
    pub const SM89: Self = Self::with(8, 9, 128, 101_376, 72 << 20, 1_008_000);
    /// H100 SXM.
    #[cfg(test)]
    pub const SM90: Self = Self::with(9, 0, 132, 232_448, 50 << 20, 3_352_000);

    /// A device of these figures whose other limits are those every GPU from sm_80 has (64 Ki
    /// registers and, sm_80 and sm_90 aside, 1536 threads per SM; the SM's shared memory is the
    /// per-block opt-in plus the driver's reserve).
    #[cfg(test)]
    pub const fn with(
        major: u32,
        minor: u32,
        sms: u32,
        smem_optin: usize,
        l2_bytes: usize,
        dram_bytes_per_us: usize,
    ) -> Self {
        Self {
            major,
            minor,
            sms,
            smem_optin,
            smem_per_sm: smem_optin + DRIVER_SMEM_PER_BLOCK,
            regs_per_sm: 65_536,
            threads_per_sm: if minor == 0 { 2048 } else { 1536 },
            l2_bytes,
            dram_bytes_per_us,
            hopper: major == 9 && minor == 0,
        }
    }

    /// The same device with the sm_90a kernels off (the portable path).
    pub const fn portable(self) -> Self {
        Self {
            hopper: false,
            ..self
        }
    }

    /// Fits a block of `smem` bytes of dynamic shared memory on this device?
    pub const fn fits(&self, smem: usize) -> bool {
        smem + STATIC_SMEM_RESERVE <= self.smem_optin
    }

    /// Blocks of `smem` bytes of dynamic shared memory, `threads` threads and `regs` registers a
    /// thread that one SM holds at once: each block also takes its static shared memory (at
    /// most [`STATIC_SMEM_RESERVE`]) and the driver's reserve.
    pub fn blocks_per_sm(&self, smem: usize, threads: usize, regs: usize) -> usize {
        let by_smem = self.smem_per_sm / (smem + STATIC_SMEM_RESERVE + DRIVER_SMEM_PER_BLOCK);
        // Registers are allocated per warp in units of 256.
        let warp_regs = (32 * regs).next_multiple_of(256);
        let by_regs = self.regs_per_sm / (warp_regs * threads.div_ceil(32)).max(1);
        let by_threads = self.threads_per_sm / threads.max(1);
        by_smem.min(by_regs).min(by_threads).min(32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residency_follows_the_tightest_limit() {
        let h100 = DeviceCaps::SM90;
        // 68 KB blocks of 128 threads: three by shared memory.
        assert_eq!(h100.blocks_per_sm(69_632, 128, 128), 3);
        // 128 threads at 255 registers: two by registers (64 Ki / (8 Ki x 4 warps)).
        assert_eq!(h100.blocks_per_sm(0, 128, 255), 2);
        // Tiny blocks: the thread limit (2048 / 128).
        assert_eq!(h100.blocks_per_sm(0, 128, 32), 16);
        assert!(h100.fits(230_000) && !h100.fits(232_000));
        assert!(!DeviceCaps::SM86.fits(110_000));
    }
}
