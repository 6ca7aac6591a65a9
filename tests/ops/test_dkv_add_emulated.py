"""The backward's CUDA dkv helper (``TRANSPOSED_ADD_SOURCE``) run on the CPU.

The helper's source text is compiled by the host C++ compiler with the few CUDA names it uses
emulated: ``threadIdx`` per thread, ``__shfl_xor_sync`` as a warp-wide exchange (32 threads meet
at a barrier, each reads its partner's slot), ``atomicAdd`` on a float4 under a lock. 256 threads
each hold a [64, chunk] accumulator's registers in the layout the helper assumes (as TileLang
lays out an m64 fp32 wgmma result over two warpgroups), every element a distinct value; after
the call each tile row's chunk must sit in its dKV row exactly once, and nothing else may be
touched. The GPU tests check the same end to end (``pytest -m gpu``); this one catches an index
slip in the helper on any machine with a C++20 compiler.
"""

import shutil
import subprocess

import pytest

from nemo_dsa.ops.sparse_attention.backward import TRANSPOSED_ADD_SOURCE

HARNESS = r"""
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
static float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct ThreadIndex { int x; };
static thread_local ThreadIndex threadIdx;
#define __device__
#define __forceinline__ inline

static float slots[256];
static std::barrier<>* warp_barrier[8];
static float __shfl_xor_sync(unsigned, float value, int lane_mask) {
  const int t = threadIdx.x, warp = t >> 5;
  slots[t] = value;
  warp_barrier[warp]->arrive_and_wait();
  const float got = slots[(warp << 5) | ((t & 31) ^ lane_mask)];
  warp_barrier[warp]->arrive_and_wait();
  return got;
}
static std::mutex add_lock;
static void atomicAdd(float4* where, float4 v) {
  std::lock_guard<std::mutex> guard(add_lock);
  where->x += v.x; where->y += v.y; where->z += v.z; where->w += v.w;
}

HELPER_SOURCE

// The value of accumulator element (row, col): distinct and exact in fp32.
static float value_of(int row, int col, int chunk) { return float(row * chunk + col + 1); }

int main(int argc, char** argv) {
  const int chunk = std::atoi(argv[1]), row_stride = chunk + 8, n_rows = 80;
  std::vector<int> rows(64);
  for (int r = 0; r < 64; ++r) rows[r] = (r % 9 == 4) ? -1 : (37 * r + 11) % n_rows;  // unseen keys: -1
  std::vector<float> dkv(size_t(n_rows) * row_stride, 0.0f);
  for (auto& b : warp_barrier) b = new std::barrier<>(32);
  std::vector<std::thread> threads;
  for (int t = 0; t < 256; ++t) {
    threads.emplace_back([&, t] {
      threadIdx.x = t;
      const int wg = t >> 7, warp = (t & 127) >> 5, lane = t & 31;
      std::vector<float> acc(64 * chunk / 256);
      for (int i = 0; i < int(acc.size()) / 2; ++i) {  // float2 number i = 2 j + h
        const int j = i / 2, h = i % 2;
        const int row = 16 * warp + (lane >> 2) + 8 * h, col = wg * chunk / 2 + 8 * j + 2 * (lane & 3);
        acc[2 * i] = value_of(row, col, chunk);
        acc[2 * i + 1] = value_of(row, col + 1, chunk);
      }
      dkv_add_transposed(acc.data(), dkv.data(), rows.data(), row_stride, chunk);
    });
  }
  for (auto& th : threads) th.join();
  std::vector<float> want(dkv.size(), 0.0f);
  for (int r = 0; r < 64; ++r)
    if (rows[r] >= 0)
      for (int c = 0; c < chunk; ++c) want[size_t(rows[r]) * row_stride + c] = value_of(r, c, chunk);
  int wrong = 0;
  for (size_t k = 0; k < dkv.size(); ++k)
    if (dkv[k] != want[k] && wrong++ < 5)
      std::printf("dkv[%zu, %zu] = %g, want %g\n", k / row_stride, k % row_stride, dkv[k], want[k]);
  std::printf("%d wrong of %zu\n", wrong, dkv.size());
  return wrong != 0;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler (g++ or clang++) to build the emulation harness")
    folder = tmp_path_factory.mktemp("dkv_add")
    source = folder / "harness.cpp"
    source.write_text(HARNESS.replace("HELPER_SOURCE", TRANSPOSED_ADD_SOURCE))
    binary = folder / "harness"
    built = subprocess.run([compiler, "-std=c++20", "-O1", "-pthread", str(source), "-o", str(binary)],
                           capture_output=True, text=True)  # fmt: skip
    if built.returncode and "barrier" in built.stderr and "No such file" in built.stderr:
        pytest.skip(f"{compiler} has no C++20 <barrier>")
    assert built.returncode == 0, built.stderr[-3000:]
    return binary


@pytest.mark.parametrize("chunk", [64, 128, 256])
def test_transposed_add_puts_every_element_in_its_row_once(harness, chunk):
    ran = subprocess.run([str(harness), str(chunk)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert ran.stdout.strip().endswith("0 wrong of " + str(80 * (chunk + 8)))


def test_emulation_catches_a_misplaced_column(harness, tmp_path):
    """The check can fail: the helper with its second exchange's column offset dropped."""
    broken = TRANSPOSED_ADD_SOURCE.replace("+ (upper ? 16 : 0)", "")
    assert broken != TRANSPOSED_ADD_SOURCE
    source, binary = tmp_path / "broken.cpp", tmp_path / "broken"
    source.write_text(HARNESS.replace("HELPER_SOURCE", broken))
    compiler = shutil.which("g++") or shutil.which("clang++")
    subprocess.run([compiler, "-std=c++20", "-O1", "-pthread", str(source), "-o", str(binary)], check=True)
    ran = subprocess.run([str(binary), "128"], capture_output=True, text=True, timeout=120)
    assert ran.returncode != 0 and " 0 wrong" not in ran.stdout
