//! Command-line choices shared by the model examples.

use anyhow::{bail, Result};
use candle::{DType, Device};

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
}

impl DeviceArg {
    pub fn device(self) -> Result<Device> {
        match self {
            DeviceArg::Cpu => Ok(Device::Cpu),
            // Checked here rather than left to candle so the user learns which flag is missing.
            DeviceArg::Cuda if !cfg!(feature = "cuda") => {
                bail!(
                    "--device cuda needs a build with the crate's `cuda` feature (--features cuda)"
                )
            }
            DeviceArg::Cuda => Ok(Device::new_cuda(0)?),
        }
    }
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum DTypeArg {
    F32,
    Bf16,
}

impl DTypeArg {
    pub fn dtype(self) -> DType {
        match self {
            DTypeArg::F32 => DType::F32,
            DTypeArg::Bf16 => DType::BF16,
        }
    }
}
