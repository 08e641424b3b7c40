//! numpy's legacy global generator (`np.random.seed(n)` then `np.random.permutation(k)`), bit for
//! bit: Mersenne Twister MT19937 with numpy's bounded-integer rejection sampling. mlx-lm draws
//! the order of its batches from it, so the same seed gives the same batches here.

const N: usize = 624;
const M: usize = 397;

pub struct NumpyRandom {
    key: [u32; N],
    pos: usize,
}

impl NumpyRandom {
    /// `np.random.seed(seed)`.
    pub fn new(seed: u32) -> Self {
        let mut key = [0u32; N];
        key[0] = seed;
        for i in 1..N {
            let prev = key[i - 1];
            key[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        NumpyRandom { key, pos: N }
    }

    fn twist(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        const MATRIX: u32 = 0x9908_b0df;
        for i in 0..N {
            let y = (self.key[i] & UPPER) | (self.key[(i + 1) % N] & LOWER);
            let mag = if y & 1 == 1 { MATRIX } else { 0 };
            self.key[i] = self.key[(i + M) % N] ^ (y >> 1) ^ mag;
        }
        self.pos = 0;
    }

    fn next_u32(&mut self) -> u32 {
        if self.pos == N {
            self.twist();
        }
        let mut y = self.key[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// A uniform integer in `0..=max` (numpy's `random_interval`: mask, then reject).
    fn interval(&mut self, max: u32) -> u32 {
        if max == 0 {
            return 0;
        }
        let mask = u32::MAX >> max.leading_zeros();
        loop {
            let v = self.next_u32() & mask;
            if v <= max {
                return v;
            }
        }
    }

    /// `np.random.permutation(n)`: a Fisher-Yates shuffle of `0..n` from the back.
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut out: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = self.interval(i as u32) as usize;
            out.swap(i, j);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values printed by numpy 2.4.6.
    #[test]
    fn permutations_match_numpy() {
        let mut rng = NumpyRandom::new(0);
        assert_eq!(rng.permutation(10), [2, 8, 4, 9, 1, 6, 7, 3, 0, 5]);
        assert_eq!(rng.permutation(3), [2, 1, 0]);
        assert_eq!(
            rng.permutation(1000)[..8],
            [921, 75, 608, 630, 380, 1, 239, 954]
        );
        let mut rng = NumpyRandom::new(12345);
        assert_eq!(
            rng.permutation(16),
            [0, 11, 7, 8, 3, 6, 12, 10, 15, 14, 9, 4, 1, 13, 5, 2]
        );
    }
}
