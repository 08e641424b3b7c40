use std::sync::Arc;

/// An immutable byte range that shares its owner: a memory map of a checkpoint file, a
/// [`WeightBuffer`] a file was read into, or an owned allocation. Weights are viewed in place
/// through [`Bytes::view`], never copied, unless the file placed them at an address their
/// element type cannot be read from (see [`Bytes::aligned`]).
#[derive(Clone)]
pub struct Bytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

/// Owned storage whose start is 8-byte aligned, so any element type can be viewed in it.
struct AlignedVec {
    words: Vec<u64>,
    len: usize,
}

impl AsRef<[u8]> for AlignedVec {
    fn as_ref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
}

/// Writable storage for weights the CPU streams through: anonymous memory that Linux is asked
/// to back with transparent huge pages, so that reading a matrix takes one TLB entry per 2 MiB
/// instead of one per 4 KiB page (a page cache's memory map gets 4 KiB pages): on 2-vCPU Xeons
/// one thread decodes up to a quarter faster from it than from a map. Elsewhere, or when the
/// kernel declines, it is plain anonymous memory.
pub struct WeightBuffer {
    map: memmap2::MmapMut,
    len: usize,
}

impl WeightBuffer {
    /// `len` zeroed bytes, page-aligned.
    pub fn new(len: usize) -> std::io::Result<Self> {
        // A map cannot be empty.
        let map = memmap2::MmapMut::map_anon(len.max(1))?;
        // Advice, not a requirement: without huge pages the buffer still works.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        Ok(WeightBuffer { map, len })
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map[..self.len]
    }

    /// The buffer, read-only from now on, as one byte range.
    pub fn freeze(self) -> std::io::Result<Bytes> {
        let owner = Arc::new(FrozenBuffer(self.map.make_read_only()?));
        Ok(Bytes {
            owner,
            start: 0,
            len: self.len,
        })
    }
}

struct FrozenBuffer(memmap2::Mmap);

impl AsRef<[u8]> for FrozenBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Bytes {
    /// Shares `owner` (for example a memory map) as one byte range.
    pub fn from_owner(owner: Arc<dyn AsRef<[u8]> + Send + Sync>) -> Self {
        let len = (*owner).as_ref().len();
        Bytes {
            owner,
            start: 0,
            len,
        }
    }

    /// Copies `data` into fresh 8-byte-aligned storage.
    pub fn copy_from(data: &[u8]) -> Self {
        let mut words = vec![0u64; data.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..data.len()].copy_from_slice(data);
        Bytes::from_owner(Arc::new(AlignedVec {
            words,
            len: data.len(),
        }))
    }

    /// Stores a vector of plain values as bytes.
    pub fn from_values<T: bytemuck::Pod>(values: &[T]) -> Self {
        Bytes::copy_from(bytemuck::cast_slice(values))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.start..self.start + self.len]
    }

    /// A sub-range of this range; `None` if it does not fit.
    pub fn slice(&self, start: usize, len: usize) -> Option<Bytes> {
        let end = start.checked_add(len)?;
        (end <= self.len).then(|| Bytes {
            owner: self.owner.clone(),
            start: self.start + start,
            len,
        })
    }

    /// This range if it starts on a multiple of `align`, else an aligned owned copy.
    pub fn aligned(self, align: usize) -> Bytes {
        if (self.as_slice().as_ptr() as usize).is_multiple_of(align) {
            self
        } else {
            Bytes::copy_from(self.as_slice())
        }
    }

    /// The bytes as a slice of `T`. The range must have been made with [`Bytes::aligned`]
    /// (or come from owned storage) and hold a whole number of `T`.
    pub fn view<T: bytemuck::Pod>(&self) -> &[T] {
        bytemuck::cast_slice(self.as_slice())
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bytes({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misaligned_ranges_are_copied_to_aligned_storage() {
        let base = Bytes::from_values(&[1u32, 2, 3, 4]);
        let odd = base.slice(1, 8).unwrap();
        assert_ne!(odd.as_slice().as_ptr() as usize % 4, 0);
        let fixed = odd.clone().aligned(4);
        assert_eq!(fixed.as_slice(), odd.as_slice());
        assert_eq!(fixed.view::<u32>().len(), 2);
        assert!(base.slice(10, 8).is_none());
    }
}
