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
    /// Peak DRAM bandwidth from the memory clock and bus width, in bytes per microsecond.
    pub dram_bytes_per_us: usize,
    /// Size of the L2 cache, in bytes.
    pub l2_bytes: usize,
    /// Run the sm_90a (wgmma + TMA) kernels where they cover the problem: compute capability
    /// 9.0, unless the caller asked for the portable path.
    pub hopper: bool,
    /// Has sm_89's e4m3 conversion instruction: the FP8-cache decode kernels of the compute_89
    /// module, unless the caller asked for the portable path (then those of compute_80).
    pub fp8: bool,
}

/// Shared memory the plan keeps free for the kernels' static `__shared__` values (a few
/// block-uniform values); the launch code checks the compiled kernels stay within it.
pub(crate) const STATIC_SMEM_RESERVE: usize = 1024;

impl DeviceCaps {
    /// A100 (SXM, 40 GB).
    #[cfg(test)]
    pub const SM80: Self = Self::with(8, 0, 108, 166_912, 1_555_000, 40 << 20);
    /// RTX 3090 class (sm_86).
    #[cfg(test)]
    pub const SM86: Self = Self::with(8, 6, 82, 101_376, 936_000, 6 << 20);
    /// RTX 4090 class (sm_89).
    #[cfg(test)]
    pub const SM89: Self = Self::with(8, 9, 128, 101_376, 1_008_000, 72 << 20);
    /// H100 SXM.
    #[cfg(test)]
    pub const SM90: Self = Self::with(9, 0, 132, 232_448, 3_352_000, 50 << 20);

    #[cfg(test)]
    pub const fn with(
        major: u32,
        minor: u32,
        sms: u32,
        smem_optin: usize,
        dram_bytes_per_us: usize,
        l2_bytes: usize,
    ) -> Self {
        Self {
            major,
            minor,
            sms,
            smem_optin,
            dram_bytes_per_us,
            l2_bytes,
            hopper: major == 9 && minor == 0,
            fp8: major > 8 || (major == 8 && minor >= 9),
        }
    }

    /// The same device with the sm_90a kernels off (the portable path).
    pub const fn portable(self) -> Self {
        Self {
            hopper: false,
            fp8: false,
            ..self
        }
    }

    /// Fits a block of `smem` bytes of dynamic shared memory on this device?
    pub const fn fits(&self, smem: usize) -> bool {
        smem + STATIC_SMEM_RESERVE <= self.smem_optin
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_limits() {
        let h100 = DeviceCaps::SM90;
        assert!(h100.fits(230_000) && !h100.fits(232_000));
        assert!(!DeviceCaps::SM86.fits(110_000));
        assert!(!h100.portable().hopper && h100.hopper);
    }
}
