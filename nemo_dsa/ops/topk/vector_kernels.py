"""A bf16 index-order select that reads each row in 16-byte vectors and lists the keys near its cut.

Same semantics as the radix select (docs/semantics.md "Top-k selection"; ``naive.select_topk_reference``):
the best T finite scores of each row in ascending index order, ties to the smaller index, -1 / -inf
padding; with ``block_size`` > 0 (V4.1 reindex layers) keys outside the row's kept candidate blocks
are never selected. One block of 256 threads a row; lane l of warp w loads 8 consecutive keys at a
time (vectors aligned in the matrix, so any width works), the first 4 vectors a lane in registers.
1. One walk: the row's maximum (three bf16x2 max instructions a vector) and, in rows of at least T
   vectors, a histogram of the vector maxima by image >> 4. The bin holding the T-th largest vector
   maximum bounds the cut from below: those T vectors each hold a key at least that large. Shorter
   rows of more than T keys (T is an eighth of them or more) count every key coarsely (image >> 8)
   in this walk instead and take the coarse bin holding the T-th key as their window (step 2).
2. A window of WINDOW_BINS images from that bound up (below the top when fewer than T vectors hold
   a finite key): each warp lists its keys at or above the window's low end (numbers and bits, in
   index order: a warp scan a vector), then counts the listed keys by image, 32 a round; keys above
   the window are taken outright. A block scan over the bins gives the cut (the T-th image and how
   many of its ties to take). A row whose cut lies below the window takes a coarse pass (image >> 8
   of every key), then the coarse bin as its window.
3. The gather ranks the listed keys with ballots (a warp whose list overflowed walks its keys).
A row of at most T keys, or with fewer than T finite ones, takes every finite key. A row holding +inf
(never selected) is read again with +inf as -inf. Every row is decided here.
Candidate blocks of 8 (the released V4.1) in the candidate source's form (ascending, -1 padded) are
read from the list, one vector a block: a reindex row reads its kept blocks only and needs no map,
and a row keeping every block is read whole. Other block sizes and other lists go through a map of
the row's blocks applied at each load.

Why: ncu put the radix select at 73.6 % issue-slot use, the ALU its
busiest pipe, ~130 thread instructions a key (a 2-byte load, an image and a test per key and walk,
two ballots per key in the gather). Here the walks test 8 keys with a few packed instructions and
the per-key work runs on listed keys with every lane busy. TileLang's Python layer has no bf16x2
max or compare and proves no 16-byte alignment for a load at a run-time offset, so the row's work is
CUDA (ROW_SOURCE) inside a TileLang kernel that owns the launch, shared memory and registers.
"""

from nemo_dsa._checks import check_positive_int
from nemo_dsa.ops._tilelang import tilelang

THREADS = 256
WARPS = THREADS // 32
# Bins of a window (one image each: two bf16 binades).
WINDOW_BINS = 256
# 16-byte vectors a lane keeps in registers (4 words each): 4 hold a row's first 8,192 keys; keys past
# them are loaded again by each later walk. 4 with 5 blocks an SM matched or beat 8 with 4 on every
# V4.1 chunk measured, long rows too. With candidate blocks 2: at 48 registers that build's three row
# paths spill with 3 or 4 (ptxas), and 2 at 5 blocks an SM beat 4 at 4 on every reindex chunk measured.
CACHED_VECTORS = 4
MASKED_CACHED_VECTORS = 2
# Candidate blocks (V4.1 reindex layers): rows of up to MASK_BLOCKS blocks (ROW_SOURCE's kMaskBlocks). A
# row's kept blocks live in KEPT_INTS of static shared memory: as a list of 16-bit block numbers (up to
# kListedBlocks = 4096) or as a map of one bit a block.
MASK_BLOCKS = 16384
KEPT_INTS = 2048
# Blocks an SM holds (__launch_bounds__): 5 caps a thread at 48 registers; with candidate blocks too, which
# the 8 KiB of kept blocks leave shared memory for (a 16 KiB byte map held them to 4).
MIN_BLOCKS_PER_SM = 5
# Shared ints of the vector maxima's histogram (4096 bins of 16 images, one pad int per 16 bins), which then
# hold the warps' lists of key numbers, and of the lists' bf16 bits (ROW_SOURCE's kListCap a warp).
MAX_BIN_SLOTS = 4096 + 4096 // 16
LIST_VALUE_SLOTS = MAX_BIN_SLOTS // 2
# Ints of the block's scratch: per-warp maxima (as floats), taken / tied counts, scan sums, counts above
# the window; the cut and the vector maxima's bound.
SCRATCH_INTS = 5 * WARPS + 8

ROW_SOURCE = r"""
#include <cuda_bf16.h>

namespace vector_select {

constexpr int kThreads = 256, kWarps = 8, kBins = 256, kKeys = 8;
constexpr unsigned kNegInf = 0xFF80u;          // bf16 bits of -inf
constexpr unsigned kLowestFinite = 0xFF7Fu;    // bf16 bits of the most negative finite value
constexpr unsigned kLowestImage = 0x0080u;     // its image: every finite key's image is >= this

// Order-preserving image of bf16 bits (as the radix select's): negatives flip every bit,
// non-negatives set the sign bit, -0 moves up to +0's image, NaN / +-inf map to 0.
__device__ __forceinline__ unsigned image_of(unsigned bits) {
  unsigned image = bits ^ (((bits >> 15) * 0x7FFFu) | 0x8000u);
  image += bits == 0x8000u;
  return (bits & 0x7F80u) != 0x7F80u ? image : 0u;
}

__device__ __forceinline__ float float_of_bits(unsigned bits) { return __uint_as_float(bits << 16); }

// The finite value whose image is ``image`` (>= kLowestImage): for finite x, x >= value <=> image_of(x) >= image.
__device__ __forceinline__ float float_of_image(unsigned image) {
  return float_of_bits(image >= 0x8000u ? image & 0x7FFFu : ~image & 0xFFFFu);
}

// Key k's bf16 bits (k may be a run-time value: selects, not an indexed register array).
__device__ __forceinline__ unsigned key_bits(const unsigned* w, int k) {
  const unsigned word = k < 4 ? (k < 2 ? w[0] : w[1]) : (k < 6 ? w[2] : w[3]);
  return (word >> (16 * (k & 1))) & 0xFFFFu;
}

__device__ __forceinline__ __nv_bfloat162 as_pair(unsigned word) { return *reinterpret_cast<__nv_bfloat162*>(&word); }

// A bf16 value (exact in ``x``) in both halves of a pair.
__device__ __forceinline__ __nv_bfloat162 splat(float x) {
  const unsigned bits = __float_as_uint(x) >> 16;
  return as_pair(bits | (bits << 16));
}

// +inf is never selected: the keys of a row holding one are read with +inf as -inf.
__device__ __forceinline__ void drop_positive_inf(unsigned* w) {
  #pragma unroll
  for (int q = 0; q < kKeys / 2; ++q) {
    const unsigned inf = __heq2_mask(as_pair(w[q]), as_pair(0x7F807F80u));
    w[q] = (w[q] & ~inf) | (inf & ((kNegInf << 16) | kNegInf));
  }
}

// The largest of a vector's 8 keys (NaN ignored, as by fmaxf; NaN only if all are).
__device__ __forceinline__ float vector_max(const unsigned* w) {
  __nv_bfloat162 m = __hmax2(__hmax2(as_pair(w[0]), as_pair(w[1])), __hmax2(as_pair(w[2]), as_pair(w[3])));
  return fmaxf(__low2float(m), __high2float(m));
}

// Bit k: key k >= bound (``greater``) or == bound, by packed bf16 compares (NaN compares false, -0 == +0).
template <bool kGreater>
__device__ __forceinline__ unsigned key_mask(const unsigned* w, __nv_bfloat162 bound) {
  unsigned bits = 0u;
  #pragma unroll
  for (int q = 0; q < kKeys / 2; ++q) {
    const unsigned m = kGreater ? __hge2_mask(as_pair(w[q]), bound) : __heq2_mask(as_pair(w[q]), bound);
    bits |= ((m & 1u) | ((m >> 15) & 2u)) << (2 * q);
  }
  return bits;
}

// The 8 keys from ``first`` (row-local): one 16-byte load when ``aligned`` (the vector starts 16-byte aligned
// in the matrix) and all lie in [start, end) and ``valid``, else key by key, -inf outside (no byte past the
// row is read).
__device__ __forceinline__ void load_vector(const unsigned short* row_keys, bool valid, int first, int start, int end,
                                            bool aligned, unsigned* w) {
  if (!valid) {
    w[0] = w[1] = w[2] = w[3] = (kNegInf << 16) | kNegInf;
    return;
  }
  if (aligned && first >= start && first + kKeys <= end) {
    const uint4 t = *reinterpret_cast<const uint4*>(row_keys + first);
    w[0] = t.x; w[1] = t.y; w[2] = t.z; w[3] = t.w;
    return;
  }
  #pragma unroll
  for (int q = 0; q < kKeys / 2; ++q) {
    const int key = first + 2 * q;
    const unsigned even = key >= start && key < end ? row_keys[key] : kNegInf;
    const unsigned odd = key + 1 >= start && key + 1 < end ? row_keys[key + 1] : kNegInf;
    w[q] = even | (odd << 16);
  }
}

// Inclusive prefix sum over the warp's lanes.
__device__ __forceinline__ unsigned warp_inclusive_sum(unsigned x) {
  #pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned other = __shfl_up_sync(0xFFFFFFFFu, x, d);
    if ((threadIdx.x & 31) >= d) x += other;
  }
  return x;
}

// Keys a warp lists: their numbers (in the vector maxima's bins, dead by then) and bf16 bits (after them).
constexpr int kListCap = 544;

// Appends the vector's keys at or above ``low`` to the warp's list (key numbers and bits, in index order: a
// warp scan places each lane's keys); ``listed`` counts them all, past kListCap too. Warp-synchronous.
__device__ __forceinline__ void list_keys(const unsigned* w, int first, __nv_bfloat162 low, int* list,
                                          unsigned short* values, int& listed) {
  unsigned bits = key_mask<true>(w, low);
  const int own = __popc(bits);
  const int inclusive = int(warp_inclusive_sum(unsigned(own)));
  int slot = listed + inclusive - own;
  listed += __shfl_sync(0xFFFFFFFFu, inclusive, 31);
  for (; bits != 0u && slot < kListCap; bits &= bits - 1u, ++slot) {
    const int k = __ffs(bits) - 1;
    list[slot] = first + k;
    values[slot] = (unsigned short)key_bits(w, k);
  }
}

// A key at or above the window's low end: counted by its distance below the window's top image, or
// added to ``above`` when larger.
__device__ __forceinline__ void count_key(unsigned bits, unsigned window_top, int* hist, int& above) {
  const unsigned image = image_of(bits);
  if (image > window_top) {
    ++above;
  } else {
    atomicAdd(hist + (window_top - image), 1);
  }
}

// count_key on every listed key, 32 a round (all lanes busy, unlike a walk over sparse keys).
__device__ __forceinline__ void count_listed(const unsigned short* values, int listed, unsigned window_top, int* hist,
                                             int& above) {
  for (int slot = threadIdx.x & 31; slot < listed; slot += 32) count_key(values[slot], window_top, hist, above);
}

// count_key on the vector's keys at or above ``low`` (a warp whose list overflowed).
__device__ __forceinline__ void count_window(const unsigned* w, __nv_bfloat162 low, unsigned window_top, int* hist,
                                             int& above) {
  for (unsigned bits = key_mask<true>(w, low); bits != 0u; bits &= bits - 1u) {
    count_key(key_bits(w, __ffs(bits) - 1), window_top, hist, above);
  }
}

// The gather over a warp's list instead of its keys: 32 listed keys a round, ranked by ballots.
__device__ __forceinline__ void gather_listed(const int* list, const unsigned short* values, int listed, float above,
                                              float equal, int need, int taken_before, int tied_before, int* index,
                                              unsigned short* picked, int count, int offset) {
  const unsigned lanes_below = (1u << (threadIdx.x & 31)) - 1u;
  for (int first = 0; first < listed; first += 32) {
    const int slot = first + (threadIdx.x & 31);
    const int key = slot < listed ? list[slot] : 0;
    const unsigned bits = slot < listed ? unsigned(values[slot]) : kNegInf;
    const float x = float_of_bits(bits);
    const bool is_taken = x >= above, is_tied = x == equal;
    const unsigned taken = __ballot_sync(0xFFFFFFFFu, is_taken), tied = __ballot_sync(0xFFFFFFFFu, is_tied);
    const int e = tied_before + __popc(tied & lanes_below);
    const int rank = taken_before + __popc(taken & lanes_below) + min(e, need);
    if ((is_taken || (is_tied && e < need)) && rank < count) {
      index[rank] = key + offset;
      picked[rank] = (unsigned short)bits;
    }
    taken_before += __popc(taken);
    tied_before += __popc(tied);
  }
}

// Vector maxima are counted by image >> 4 (4096 bins, 16 images each), bin b at b + b / 16 so that the
// 16 bins a thread scans fall in distinct banks.
constexpr int kMaxBins = 4096, kMaxBinShift = 4;
static_assert(kListCap * kWarps == kMaxBins + kMaxBins / 16, "the warps' lists fill the vector maxima's bins");
__device__ __forceinline__ int max_bin_slot(int bin) { return bin + (bin >> 4); }

// The lowest image of the bin holding the T-th largest vector maximum (``wanted`` = T), or 0 when fewer
// than T vectors hold a finite key: every one of those T vectors holds a key at least that large, so the
// T-th largest key is not below it. Thread t owns the 16 bins from 4095 - 16 t down. Two barriers.
__device__ __forceinline__ void find_vector_bound(const int* bins, int wanted, int* warp_sums, int* bound) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int first = kMaxBins - 1 - 16 * t;
  int here = 0;
  #pragma unroll
  for (int j = 0; j < 16; ++j) here += bins[max_bin_slot(first - j)];
  int running = int(warp_inclusive_sum(unsigned(here)));
  if (lane == 31) warp_sums[warp] = running;
  __syncthreads();
  for (int b = 0; b < warp; ++b) running += warp_sums[b];
  if (running >= wanted && running - here < wanted) {
    int before = running - here, j = 0;
    while (before + bins[max_bin_slot(first - j)] < wanted) before += bins[max_bin_slot(first - j++)];
    *bound = (first - j) << kMaxBinShift;
  }
  __syncthreads();
}

// Every finite key by its image's high byte, as the distance below byte 255.
__device__ __forceinline__ void count_coarse(const unsigned* w, int* hist) {
  for (unsigned bits = key_mask<true>(w, splat(float_of_bits(kLowestFinite))); bits != 0u; bits &= bits - 1u) {
    atomicAdd(hist + (255u - (image_of(key_bits(w, __ffs(bits) - 1)) >> 8)), 1);
  }
}

// Packed counts of the vector's keys taken for x >= above (low half) and tied with the cut (high half).
__device__ __forceinline__ unsigned tally(const unsigned* w, __nv_bfloat162 above, __nv_bfloat162 equal) {
  return __popc(key_mask<true>(w, above)) | (__popc(key_mask<false>(w, equal)) << 16);
}

// One warp's 256 keys (lane l: keys first .. first + 7, in index order lane by lane): each taken key's
// rank among the row's picks is the taken keys before it + min(tied keys before it, need); a tied
// key is taken while fewer than ``need`` tied keys precede it. Warp-synchronous.
__device__ __forceinline__ void gather(const unsigned* w, int first, __nv_bfloat162 above, __nv_bfloat162 equal,
                                       int need, int& taken_before, int& tied_before, int* index,
                                       unsigned short* picked, int count, int offset) {
  const unsigned taken = key_mask<true>(w, above), tied = key_mask<false>(w, equal);
  if (__ballot_sync(0xFFFFFFFFu, (taken | tied) != 0u) == 0u) return;
  const unsigned own = __popc(taken) | (__popc(tied) << 16);
  const unsigned inclusive = warp_inclusive_sum(own);
  const unsigned total = __shfl_sync(0xFFFFFFFFu, inclusive, 31);
  const int above_before = taken_before + int((inclusive - own) & 0xFFFFu);
  const int equal_before = tied_before + int((inclusive - own) >> 16);
  for (unsigned bits = taken | tied; bits != 0u; bits &= bits - 1u) {
    const int k = __ffs(bits) - 1;
    const unsigned below = (1u << k) - 1u;
    const int a = above_before + __popc(taken & below), e = equal_before + __popc(tied & below);
    const int rank = a + min(e, need);
    if ((((taken >> k) & 1u) || e < need) && rank < count) {
      index[rank] = first + k + offset;
      picked[rank] = (unsigned short)key_bits(w, k);
    }
  }
  taken_before += int(total & 0xFFFFu);
  tied_before += int(total >> 16);
}

__device__ __forceinline__ int warp_sum(int x) {
  #pragma unroll
  for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, d);
  return x;
}

// Thread t owns distance t below the top image (the sum of ``kRows`` histograms); the block's inclusive
// scan over distances counts the keys at or above each image. The thread where it reaches ``wanted``
// writes cut = {1, above image, equal image, need}; cut[0] stays as it was when no thread does.
// Every thread calls it (two barriers).
template <int kRows>
__device__ __forceinline__ void find_cut(const int* hist, int wanted, unsigned top_image, int* warp_sums, int* cut) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  int here = 0;
  #pragma unroll
  for (int b = 0; b < kRows; ++b) here += hist[b * kBins + t];
  int running = int(warp_inclusive_sum(unsigned(here)));
  if (lane == 31) warp_sums[warp] = running;
  __syncthreads();
  for (int b = 0; b < warp; ++b) running += warp_sums[b];
  if (running >= wanted && running - here < wanted) {
    const int left = wanted - (running - here);
    cut[0] = 1;
    cut[1] = int(top_image) - t + (here == left ? 0 : 1);
    cut[2] = int(top_image) - t;
    cut[3] = here == left ? 0 : left;
  }
  __syncthreads();
}

// A listed block number, read from shared memory where it is used: as a plain load the compiler keeps a
// lane's first kept blocks in registers across the walks, and the row's register cache spills (ptxas).
__device__ __forceinline__ int load_listed(const unsigned short* p) {
  unsigned short value;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(value) : "r"(unsigned(__cvta_generic_to_shared(p))));
  return int(value);
}

// A block's row: warp w owns ``segment`` vectors (a multiple of 32) from vector w * segment, lane l
// every 32nd of them from l, so that each warp load reads 512 contiguous bytes. Vector v holds keys
// base + 8 v .. + 7, or with kListed (candidate blocks of 8) the keys of the row's v-th kept block,
// start + 8 listed[v] .. + 7: the row reads its kept blocks only, in index order.
template <int kBlock, bool kListed>
struct Row {
  const unsigned short* keys;  // the row's key 0
  const unsigned* kept;        // kBlock > 0, not kListed: the row's candidate-block map (bit set = kept)
  const unsigned short* listed;  // kListed: the row's kept blocks, ascending
  int start, end, base, vectors, segment, steps, limit, warp, lane;
  bool aligned;                // the vectors start 16-byte aligned (always, unless kListed and ks's position is not)
  bool drop_inf = false;       // read +inf as -inf (a row holding one)

  __device__ __forceinline__ Row(const void* scores, int row, int width, int row_start, int row_end,
                                 const int* kept_words, int listed_blocks)
      : kept(reinterpret_cast<const unsigned*>(kept_words)), listed(reinterpret_cast<const unsigned short*>(kept_words)) {
    warp = threadIdx.x >> 5;
    lane = threadIdx.x & 31;
    start = min(max(row_start, 0), width);
    end = max(min(row_end, width), start);
    const long long row_key = (long long)row * width;
    keys = static_cast<const unsigned short*>(scores) + row_key;
    // Vectors start at matrix positions that are multiples of 8 (the wrapper keeps the matrix 16-byte aligned);
    // a kept block starts at start + 8 b, so blocks are aligned when the row's position of ks is.
    base = int(((row_key + start) & ~(long long)(kKeys - 1)) - row_key);
    aligned = !kListed || ((row_key + start) & (kKeys - 1)) == 0;
    vectors = kListed ? listed_blocks : (end - base + kKeys - 1) / kKeys;
    segment = (vectors + kThreads - 1) / kThreads * 32;
    steps = segment / 32;
    limit = min(vectors, (warp + 1) * segment);
  }
  __device__ __forceinline__ int vector(int step) const { return warp * segment + 32 * step + lane; }
  __device__ __forceinline__ int first_key(int step) const {
    if (kListed) return vector(step) < limit ? start + kKeys * load_listed(listed + vector(step)) : start;
    return base + kKeys * vector(step);
  }
  __device__ __forceinline__ void load(int step, unsigned* w) const {
    const int first = first_key(step);
    load_vector(keys, vector(step) < limit, first, start, end, aligned, w);
    if (drop_inf) drop_positive_inf(w);
    if (kBlock > 0 && !kListed) {  // keys of blocks the row does not keep are -inf (never selected)
      #pragma unroll
      for (int k = 0; k < kKeys; ++k) {
        const unsigned from_start = unsigned(first + k - start);
        const unsigned block = from_start / kBlock;
        if (from_start < unsigned(end - start) && ((kept[block >> 5] >> (block & 31)) & 1u) == 0u) {
          w[k >> 1] = (k & 1) ? (w[k >> 1] & 0xFFFFu) | (kNegInf << 16) : (w[k >> 1] & 0xFFFF0000u) | kNegInf;
        }
      }
    }
  }
};

// The row's candidate-block map: blocks of kBlock keys from ``start``, a set bit for those in ``blocks`` (-1
// and blocks past the row skipped). Two barriers.
template <int kBlock>
__device__ __forceinline__ void fill_block_map(unsigned* kept, const int* blocks, int kept_width, int start, int end) {
  const int row_blocks = (end - start + kBlock - 1) / kBlock;
  for (int i = threadIdx.x; i < (row_blocks + 31) / 32; i += kThreads) kept[i] = 0u;
  __syncthreads();
  for (int i = threadIdx.x; i < kept_width; i += kThreads) {
    const int block = blocks[i];
    if (block >= 0 && block < row_blocks) atomicOr(kept + (block >> 5), 1u << (block & 31));
  }
  __syncthreads();
}

// use(vector, its first key) on each of the lane's vectors in order: the cached ones from registers,
// the rest loaded again two at a time (both loads in flight before either is used).
template <int kCached, typename TRow, typename Use>
__device__ __forceinline__ void walk(const TRow& row, unsigned (&cache)[kCached][4], Use use) {
  #pragma unroll
  for (int i = 0; i < kCached; ++i) {
    if (i < row.steps) use(cache[i], row.first_key(i));
  }
  for (int i = kCached; i < row.steps; i += 2) {
    unsigned a[4], b[4];
    row.load(i, a);
    row.load(i + 1, b);
    use(a, row.first_key(i));
    if (i + 1 < row.steps) use(b, row.first_key(i + 1));
  }
}

// Block sum of one int a thread (every thread gets it; one barrier, ``slots`` holds kWarps ints).
__device__ __forceinline__ int block_sum(int x, int* slots) {
  x = warp_sum(x);
  if ((threadIdx.x & 31) == 0) slots[threadIdx.x >> 5] = x;
  __syncthreads();
  int total = 0;
  #pragma unroll
  for (int b = 0; b < kWarps; ++b) total += slots[b];
  return total;
}

// Candidate blocks of 8 (one vector each) whose list fits the map's shared memory as 16-bit numbers are read
// from the list itself: copies the row's list to ``listed`` and returns how many kept blocks it holds, or -1
// unless those come first and in ascending order (the candidate source's form), followed only by entries
// the map ignores (-1, blocks past the row). ``source_form``: the caller vouches for that form, so only
// the first ``row_blocks`` entries are read, unchecked. One barrier.
constexpr int kMaskBlocks = 16384, kListedBlocks = 4096;
__device__ __forceinline__ int list_kept_blocks(const int* blocks, int kept_width, bool source_form, int row_blocks,
                                                unsigned short* listed, int* slots) {
  int kept = 0, disordered = 0;
  const int entries = source_form ? min(kept_width, row_blocks) : kept_width;
  for (int i = threadIdx.x; i < entries; i += kThreads) {
    const int block = blocks[i];
    listed[i] = (unsigned short)block;  // read only where kept: 0 <= block < row_blocks <= kMaskBlocks
    const bool in_row = block >= 0 && block < row_blocks;
    kept += in_row;
    if (!source_form && in_row && i > 0) {
      const int before = blocks[i - 1];
      disordered += before < 0 || before >= block;  // else the block before is kept too, and smaller
    }
  }
  const int total = block_sum(kept | (disordered << 16), slots);
  return (total >> 16) != 0 ? -1 : total & 0xFFFF;
}

__device__ __forceinline__ void clear_histograms(int* hist) {
  #pragma unroll
  for (int b = 0; b < kWarps; ++b) hist[b * kBins + threadIdx.x] = 0;
}

__device__ __forceinline__ void clear_max_bins(int* max_bins) {
  #pragma unroll
  for (int j = 0; j < (kMaxBins + kMaxBins / 16) / kThreads; ++j) max_bins[j * kThreads + threadIdx.x] = 0;
}

// One row (``listed``: its kept blocks in ``kept_words`` when kListed). ``row_blocks``: its candidate-block list.
template <int kCached, int kBlock, bool kListed>
__device__ __forceinline__ void select_listed_or_mapped(const void* scores, int row_number, int width, int row_start,
                                                        int row_end, int count, int offset, int* index, void* picked_out,
                                                        int* hist, int* scratch, const int* row_blocks, int kept_width,
                                                        int* kept_words, int listed_blocks) {
  const int tx = threadIdx.x;
  Row<kBlock, kListed> row(scores, row_number, width, row_start, row_end, kept_words, listed_blocks);
  if (kBlock > 0 && !kListed) {
    fill_block_map<kBlock>(reinterpret_cast<unsigned*>(kept_words), row_blocks, kept_width, row.start, row.end);
  }
  const int warp = row.warp, lane = row.lane;
  unsigned short* picked = static_cast<unsigned short*>(picked_out);
  float* warp_best = reinterpret_cast<float*>(scratch);
  int* warp_taken = scratch + kWarps;
  int* warp_tied = scratch + 2 * kWarps;
  int* warp_sums = scratch + 3 * kWarps;
  int* warp_above = scratch + 4 * kWarps;
  int* cut = scratch + 5 * kWarps;
  int* vector_bound = cut + 4;
  int* own_hist = hist + warp * kBins;
  int* max_bins = hist + kWarps * kBins;
  int* own_list = max_bins + warp * kListCap;  // after the vector bound: max_bins is dead
  unsigned short* own_values = reinterpret_cast<unsigned short*>(max_bins + kMaxBins + kMaxBins / 16) + warp * kListCap;
  int listed = 0;

  const int row_keys = kListed ? min(kKeys * listed_blocks, row.end - row.start) : row.end - row.start;
  // A row of at least T vectors bins its vector maxima (the T-th largest bounds the cut). A shorter row of
  // more than T keys, whose cut lies deep in the row (T is an eighth of it or more), bins every key coarsely
  // (image >> 8) instead and takes the coarse bin holding the T-th key as its window at once.
  const bool bound_by_vectors = row.vectors >= count;
  const bool coarse_first = !bound_by_vectors && row_keys > count;
  clear_histograms(hist);
  if (bound_by_vectors) clear_max_bins(max_bins);
  if (tx == 0) cut[0] = vector_bound[0] = 0;
  // The row's first kCached vectors a lane: every load issued before any is used, and in flight across the
  // barrier that orders the clears before any count.
  unsigned cache[kCached][4];
  #pragma unroll
  for (int i = 0; i < kCached; ++i) row.load(i, cache[i]);
  __syncthreads();
  // The row's maximum and its vector maxima's (or keys' coarse) histogram; the barrier orders both.
  float top = -INFINITY;
  auto find_top = [&]() {
    float best = -INFINITY;
    walk(row, cache, [&](const unsigned* w, int) {
      const float m = vector_max(w);
      const unsigned image = image_of(__float_as_uint(m) >> 16);
      if (bound_by_vectors && image != 0u) atomicAdd(max_bins + max_bin_slot(image >> kMaxBinShift), 1);
      if (coarse_first) count_coarse(w, own_hist);
      best = fmaxf(best, m);
    });
    #pragma unroll
    for (int d = 16; d > 0; d >>= 1) best = fmaxf(best, __shfl_xor_sync(0xFFFFFFFFu, best, d));
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    top = warp_best[0];
    #pragma unroll
    for (int b = 1; b < kWarps; ++b) top = fmaxf(top, warp_best[b]);
  };
  find_top();
  if (top == INFINITY) {  // +inf is never selected: the row again, +inf read as -inf
    row.drop_inf = true;
    #pragma unroll
    for (int i = 0; i < kCached; ++i) drop_positive_inf(cache[i]);
    if (bound_by_vectors) clear_max_bins(max_bins);
    if (coarse_first) clear_histograms(hist);
    __syncthreads();  // every thread has read the warps' maxima
    find_top();
  }
  float above = float_of_bits(kLowestFinite), equal = __int_as_float(0x7FC00000);  // every finite key; none tied
  int need = 0, above_window = 0;
  bool window = row_keys > count && top > -INFINITY;  // else every finite key is taken
  unsigned window_top = 0u, above_image = 0u, equal_image = 0u;
  if (window) {
    unsigned low_image = 0u;
    // Lists the keys from ``low_end`` up, counts them in the window, returns the row's keys above it.
    auto count_from = [&](__nv_bfloat162 low_end) {
      walk(row, cache, [&](const unsigned* w, int first) { list_keys(w, first, low_end, own_list, own_values, listed); });
      if (listed <= kListCap) {
        count_listed(own_values, listed, window_top, own_hist, above_window);
      } else {
        walk(row, cache, [&](const unsigned* w, int) { count_window(w, low_end, window_top, own_hist, above_window); });
      }
      return block_sum(above_window, warp_above);  // its barrier also orders the histograms
    };
    int above_total = 0;
    if (!coarse_first) {
      // The window: WINDOW_BINS images from the vector maxima's bound up (the keys above it all taken), or
      // below the top when fewer than T vectors hold a finite key.
      const unsigned top_image = image_of(__float_as_uint(top) >> 16);
      if (bound_by_vectors) find_vector_bound(max_bins, count, warp_sums, vector_bound);
      low_image = unsigned(vector_bound[0]);
      if (low_image == 0u) low_image = top_image >= kLowestImage + kBins - 1 ? top_image - (kBins - 1) : kLowestImage;
      low_image = max(low_image, kLowestImage);
      window_top = min(top_image, low_image + (kBins - 1));
      above_total = count_from(splat(float_of_image(low_image)));
      if (above_total < count) find_cut<kWarps>(hist, count - above_total, window_top, warp_sums, cut);
    }
    if (cut[0] == 0) {
      // The T-th key lies further down (or the row bins coarsely first): the coarse bin (image >> 8) holding
      // it, then that bin as the window, every key above it taken.
      if (!coarse_first) {
        clear_histograms(hist);
        __syncthreads();
        walk(row, cache, [&](const unsigned* w, int) { count_coarse(w, own_hist); });
        __syncthreads();
      }
      find_cut<kWarps>(hist, count, 255u, warp_sums, cut);
      window = cut[0] != 0;  // else fewer than T finite keys in a row of more than T keys: every one is taken
      if (window) {
        const unsigned coarse = unsigned(cut[2]);
        window_top = (coarse << 8) | 0xFFu;
        low_image = max(coarse << 8, kLowestImage);
        clear_histograms(hist);
        __syncthreads();  // every thread has read the coarse cut
        if (tx == 0) cut[0] = 0;
        above_window = 0;
        listed = 0;
        above_total = count_from(splat(float_of_image(low_image)));
        // Reaches the T-th key: the coarse bin holds it.
        find_cut<kWarps>(hist, count - above_total, window_top, warp_sums, cut);
      }
    }
    if (window) {
      above_image = unsigned(cut[1]);
      equal_image = unsigned(cut[2]);
      need = cut[3];
      above = float_of_image(above_image);
      if (need > 0) equal = float_of_image(equal_image);
    }
  }

  // Each warp's taken and tied keys: from its histogram (every taken key lies in or above the window) or a walk.
  const __nv_bfloat162 above2 = splat(above), equal2 = splat(equal);
  int taken = 0, tied = 0;
  if (window) {
    taken = above_window;
    #pragma unroll
    for (int j = 0; j < kBins / 32; ++j) {
      const int distance = lane * (kBins / 32) + j;
      const int here = own_hist[distance];
      taken += window_top - distance >= above_image ? here : 0;
      tied += need > 0 && window_top - distance == equal_image ? here : 0;
    }
  } else {
    unsigned counts = 0u;
    walk(row, cache, [&](const unsigned* w, int) { counts += tally(w, above2, equal2); });
    taken = int(counts & 0xFFFFu);
    tied = int(counts >> 16);
  }
  taken = warp_sum(taken);
  tied = warp_sum(tied);
  if (lane == 0) {
    warp_taken[warp] = taken;
    warp_tied[warp] = tied;
  }
  __syncthreads();
  int taken_total = 0, tied_total = 0;
  taken = 0;
  tied = 0;
  #pragma unroll
  for (int b = 0; b < kWarps; ++b) {
    taken += b < warp ? warp_taken[b] : 0;
    tied += b < warp ? warp_tied[b] : 0;
    taken_total += warp_taken[b];
    tied_total += warp_tied[b];
  }
  if (window && listed <= kListCap) {  // every key at or above the window's low end is listed
    gather_listed(own_list, own_values, listed, above, equal, need, taken, tied, index, picked, count, offset);
  } else {
    walk(row, cache, [&](const unsigned* w, int first) {
      gather(w, first, above2, equal2, need, taken, tied, index, picked, count, offset);
    });
  }
  const int written = min(taken_total + min(tied_total, need), count);
  for (int slot = written + tx; slot < count; slot += kThreads) {
    index[slot] = -1;
    picked[slot] = (unsigned short)kNegInf;
  }
}

// The kernel's row: candidate blocks of 8 in the candidate source's form (list_kept_blocks) are read
// from the list, any other kept blocks through the map; a row keeping every one of its blocks is read whole.
template <int kCached, int kBlock>
__device__ __forceinline__ void select_row(const void* scores, int row_number, int width, int row_start, int row_end,
                                           int count, int offset, int* index, void* picked_out, int* hist, int* scratch,
                                           const int* blocks, int kept_width, int* kept_words, bool source_form) {
  const int* row_blocks = blocks + (long long)row_number * kept_width;
  if constexpr (kBlock == kKeys) {
    if (kept_width <= kListedBlocks) {
      const int start = min(max(row_start, 0), width), end = max(min(row_end, width), start);
      const int blocks_of_row = (end - start + kKeys - 1) / kKeys;
      // In the source's form, the row keeps all its blocks iff its entry blocks_of_row - 1 is the last one.
      const bool every_block = source_form && blocks_of_row <= kept_width &&
                               (blocks_of_row == 0 || row_blocks[blocks_of_row - 1] == blocks_of_row - 1);
      const int listed = every_block ? blocks_of_row
                                     : list_kept_blocks(row_blocks, kept_width, source_form, blocks_of_row,
                                                        reinterpret_cast<unsigned short*>(kept_words), scratch + 3 * kWarps);
      if (listed == blocks_of_row) {
        select_listed_or_mapped<kCached, 0, false>(scores, row_number, width, row_start, row_end, count, offset, index,
                                                   picked_out, hist, scratch, row_blocks, kept_width, kept_words, 0);
        return;
      }
      if (listed >= 0) {
        select_listed_or_mapped<kCached, kBlock, true>(scores, row_number, width, row_start, row_end, count, offset,
                                                       index, picked_out, hist, scratch, row_blocks, kept_width,
                                                       kept_words, listed);
        return;
      }
    }
  }
  select_listed_or_mapped<kCached, kBlock, false>(scores, row_number, width, row_start, row_end, count, offset, index,
                                                  picked_out, hist, scratch, row_blocks, kept_width, kept_words, 0);
}

}  // namespace vector_select
"""


def vector_select_kernel(block_size: int = 0, cached_vectors: int | None = None, min_blocks: int = MIN_BLOCKS_PER_SM):
    """PrimFunc of the vector select (index order, bf16; one block of 256 threads per row).

    Scores bf16 [rows, width] (any width, the matrix 16-byte aligned: the wrapper checks), KS/KE
    int32 [rows] (the row's visible keys, clamped to [0, width]), Index int32 / Picked bf16 [rows,
    count] (window-local key numbers + ``offset``, -1 / -inf padding), Blocks int32 [rows,
    kept_width] with ``block_size`` > 0: the rows' kept candidate blocks, counted from ks (a row of
    more than MASK_BLOCKS blocks of ``block_size``: the wrapper checks); ``source_form`` != 0: the
    caller vouches that each list is in the candidate source's form (ascending, then -1).
    ``cached_vectors`` defaults to CACHED_VECTORS, or MASKED_CACHED_VECTORS with ``block_size``.
    """
    check_positive_int("block_size", block_size, minimum=0)
    if cached_vectors is None:
        cached_vectors = MASKED_CACHED_VECTORS if block_size else CACHED_VECTORS
    check_positive_int("cached_vectors", cached_vectors)
    check_positive_int("min_blocks", min_blocks)
    T = tilelang().language
    i32 = T.int32
    rows, width, count = T.dynamic("rows"), T.dynamic("width"), T.dynamic("count")
    block_rows, kept_width = T.dynamic("block_rows"), T.dynamic("kept_width")

    @T.prim_func
    def vector_select(
        Scores: T.Tensor([rows, width], T.bfloat16),
        KS: T.Tensor([rows], i32),
        KE: T.Tensor([rows], i32),
        Index: T.Tensor([rows, count], i32),
        Picked: T.Tensor([rows, count], T.bfloat16),
        offset: i32,
        Blocks: T.Tensor([block_rows, kept_width], i32),
        source_form: i32,
    ):
        with T.Kernel(rows, threads=THREADS) as row:
            T.import_source(ROW_SOURCE)
            T.annotate_min_blocks_per_sm(min_blocks)
            # Per warp, then the vector maxima's (later the lists' key numbers), then the lists' bits.
            hist = T.alloc_shared([WARPS * WINDOW_BINS + MAX_BIN_SLOTS + LIST_VALUE_SLOTS], i32)
            scratch = T.alloc_shared([SCRATCH_INTS], i32)
            # Static, as the radix select's: the row's kept candidate blocks (block_size > 0), a bit map
            # or, for blocks of 8, the list itself (16-bit block numbers).
            kept = T.alloc_shared([KEPT_INTS if block_size else 1], i32, scope="shared")
            T.call_extern(
                "handle", f"vector_select::select_row<{cached_vectors}, {block_size}>",
                T.address_of(Scores[0, 0]), row, width, KS[row], KE[row], count, offset,
                T.address_of(Index[row, 0]), T.address_of(Picked[row, 0]),
                T.address_of(hist[0]), T.address_of(scratch[0]), T.address_of(Blocks[0, 0]), kept_width,
                T.address_of(kept[0]), source_form != 0,
            )  # fmt: skip

    return vector_select
