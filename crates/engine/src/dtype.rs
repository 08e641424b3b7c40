/// Element types that appear in MLX checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    U32,
    I32,
    U8,
    I8,
    Bool,
    I64,
    U64,
    F64,
    U16,
    I16,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::U8 | DType::I8 | DType::Bool => 1,
            DType::F16 | DType::BF16 | DType::U16 | DType::I16 => 2,
            DType::F32 | DType::U32 | DType::I32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::U32 => "uint32",
            DType::I32 => "int32",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::Bool => "bool",
            DType::I64 => "int64",
            DType::U64 => "uint64",
            DType::F64 => "float64",
            DType::U16 => "uint16",
            DType::I16 => "int16",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
