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
                bail!("--device cuda needs a build with --features models,cuda,candle-nn/cuda")
            }
            DeviceArg::Cuda => {
                let dev = Device::new_cuda(0)?;
                // Norms, rotary embeddings and softmax are candle-nn kernels, present on the GPU
                // only when candle-nn itself is built with its `cuda` feature.
                let probe = candle::Tensor::zeros((1, 1), DType::F32, &dev)?;
                if candle_nn::ops::softmax_last_dim(&probe).is_err() {
                    bail!("candle-nn was built without its CUDA kernels: add --features candle-nn/cuda")
                }
                Ok(dev)
            }
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
