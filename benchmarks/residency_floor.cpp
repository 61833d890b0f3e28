// Lower bound of the residency_update row work on this CPU, for the table-based algorithm the kernel uses.
//
// Runs only the four loops every row of kvoffload::residency_update needs, without validation, without
// writing the state or outputs, without pass 2 and without torch: fill a direct-address position table
// with a row's top-k (with the duplicate check), match the row's slot tokens against it (branch-free,
// scattering the hit slots), partition the LRU order into hit and non-hit slots (with the permutation
// flags), and zero the table when its row tags run out (the kernel's tagged table: an entry counts for a
// row iff it carries the row's tag, 31 tags between zeroings). With AVX2 the matching and the partition
// are the kernel's AVX2 loops (one
// gather per 8 slots; lists packed with one lane permutation and vector store per 8 entries); the scalar
// partition is timed as well, for comparison. Shapes as in benchmarks/sparse_decode_bench.py: R = 64
// rows, K = 2048, C = 4096 slots, positions in [0, 65536), 1600 of the C residents selected. "cold" gives
// every row of every step its own data (as a decode step does); "hot" repeats two rows, so everything is
// in L1/L2.
// A second table, "contract", times only the memory operations the op's contract implies for a row, each
// in the cheapest form found on this CPU and with no logic around it: write the K top-k
// entries into a position table, probe it with the C slot tokens, mark the C slots of the LRU order (the
// permutation check), and read and rewrite the row's state (slot tokens and order) and its three [K]
// outputs sequentially. It leaves out the join of hits to top-k entries, the order partition, the slot
// assignment and every check, so an implementation that matches through a position table costs more than
// its total.
// Prints cycles (rdtsc) and ns per (row, slot), best step of 30, and writes
// benchmarks/results/residency_floor.json.
//
//   g++ -O3 -march=native benchmarks/residency_floor.cpp -o /tmp/residency_floor && /tmp/residency_floor
#include <immintrin.h>
#include <x86intrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int R = 64, K = 2048, C = 4096, L = 65536, STEPS = 30, SELECTED = 1600;
constexpr int kIndexBits = 11;  // table entry: tag << 11 | top-k index
constexpr uint32_t kMaxTag = 31;

struct Rows {
  std::vector<std::vector<int32_t>> topk, tokens, order;
};

Rows make_rows(int n, std::mt19937& rng) {
  Rows rows;
  std::vector<int32_t> perm(L);
  for (int i = 0; i < n; ++i) {
    for (int p = 0; p < L; ++p) {
      perm[p] = p;
    }
    std::shuffle(perm.begin(), perm.end(), rng);
    rows.topk.emplace_back(perm.begin(), perm.begin() + K);
    std::vector<int32_t> res(perm.begin(), perm.begin() + SELECTED);
    res.insert(res.end(), perm.begin() + K, perm.begin() + K + (C - SELECTED));
    std::shuffle(res.begin(), res.end(), rng);
    rows.tokens.push_back(res);
    std::vector<int32_t> o(C);
    for (int s = 0; s < C; ++s) {
      o[s] = s;
    }
    std::shuffle(o.begin(), o.end(), rng);
    rows.order.push_back(o);
  }
  return rows;
}

struct Phases {
  double fill, match, partition, zero, scalar_partition;
  double total() const { return fill + match + partition + zero; }
};

// The scalar partition: one store per list and a marked flag per slot.
long partition_scalar(const int32_t* order, uint8_t* flags, int32_t* hits, int32_t* nonhit, uint32_t& twice) {
  long b = 0;
  for (int j = 0; j < C; ++j) {
    const int32_t s = order[j];
    const uint32_t f = flags[s];
    flags[s] = static_cast<uint8_t>(f | 2);
    twice |= f;
    hits[b] = s;
    nonhit[j - b] = s;
    b += f & 1;
  }
  return b;
}

#ifdef __AVX2__
struct PackTable {
  uint64_t pack[256];  // the set lanes of an 8-bit mask, in order (a vpermd control)
  PackTable() {
    for (int m = 0; m < 256; ++m) {
      pack[m] = 0;
      for (int lane = 0, n = 0; lane < 8; ++lane) {
        if ((m >> lane) & 1) {
          pack[m] |= static_cast<uint64_t>(lane) << (8 * n++);
        }
      }
    }
  }
};
const PackTable kPack;

__m256i pack_control(uint32_t m) {
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(kPack.pack[m])));
}

// The kernel's AVX2 partition: scalar flag reads and marks, lists packed 8 entries per vector store.
long partition_packed(const int32_t* order, uint8_t* flags, int32_t* hits, int32_t* nonhit, uint32_t& twice) {
  long b = 0;
  for (int j = 0; j < C; j += 8) {
    uint32_t m = 0;
#pragma GCC unroll 8
    for (int lane = 0; lane < 8; ++lane) {
      const int32_t s = order[j + lane];
      const uint32_t f = flags[s];
      flags[s] = static_cast<uint8_t>(f | 2);
      twice |= f;
      m |= (f & 1) << lane;
    }
    const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(order + j));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hits + b), _mm256_permutevar8x32_epi32(o, pack_control(m)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(nonhit + (j - b)),
                        _mm256_permutevar8x32_epi32(o, pack_control(~m & 0xffu)));
    b += __builtin_popcount(m);
  }
  return b;
}
// byte i of kMaskBytes.bytes[m] is bit i of the 8-bit mask m
struct MaskBytes {
  uint64_t bytes[256];
  MaskBytes() {
    for (int m = 0; m < 256; ++m) {
      bytes[m] = 0;
      for (int i = 0; i < 8; ++i) {
        bytes[m] |= static_cast<uint64_t>((m >> i) & 1) << (8 * i);
      }
    }
  }
};
const MaskBytes kMaskBytes;

// The kernel's AVX2 matching: one gather of table entries per 8 slots, the flags from the comparison of
// their tags with the row's, every lane storing its slot (the selected ones at their top-k entry, the
// others at the sink K).
long match_gather(const int32_t* stt, const uint16_t* table, uint32_t tag, int32_t* hit, uint8_t* flags) {
  const __m256i low = _mm256_set1_epi32(0xffff), index_mask = _mm256_set1_epi32((1 << kIndexBits) - 1);
  const __m256i vtag = _mm256_set1_epi32(static_cast<int>(tag)), sink = _mm256_set1_epi32(K);
  long n = 0;
  for (int s = 0; s < C; s += 8) {
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(stt + s));
    const __m256i e = _mm256_and_si256(_mm256_i32gather_epi32(reinterpret_cast<const int*>(table), t, 2), low);
    const __m256i sel = _mm256_cmpeq_epi32(_mm256_srli_epi32(e, kIndexBits), vtag);
    const __m256i k = _mm256_and_si256(e, index_mask);
    const int m = _mm256_movemask_ps(_mm256_castsi256_ps(sel));
    std::memcpy(flags + s, &kMaskBytes.bytes[m], 8);
    n += __builtin_popcount(static_cast<unsigned>(m));
    const __m256i d = _mm256_blendv_epi8(sink, k, sel);
    const __m128i lo = _mm256_castsi256_si128(d), hi = _mm256_extracti128_si256(d, 1);
    const auto d0 = static_cast<uint64_t>(_mm_cvtsi128_si64(lo));
    const auto d1 = static_cast<uint64_t>(_mm_extract_epi64(lo, 1));
    const auto d2 = static_cast<uint64_t>(_mm_cvtsi128_si64(hi));
    const auto d3 = static_cast<uint64_t>(_mm_extract_epi64(hi, 1));
    hit[static_cast<uint32_t>(d0)] = s;
    hit[d0 >> 32] = s + 1;
    hit[static_cast<uint32_t>(d1)] = s + 2;
    hit[d1 >> 32] = s + 3;
    hit[static_cast<uint32_t>(d2)] = s + 4;
    hit[d2 >> 32] = s + 5;
    hit[static_cast<uint32_t>(d3)] = s + 6;
    hit[d3 >> 32] = s + 7;
  }
  return n;
}
#else
long match_gather(const int32_t* stt, const uint16_t* table, uint32_t tag, int32_t* hit, uint8_t* flags) {
  long n = 0;
  for (int s = 0; s < C; ++s) {
    const uint32_t e = table[stt[s]];
    const uint32_t sel = (e >> kIndexBits) == tag;
    const uint32_t k = e & ((1u << kIndexBits) - 1);
    hit[K ^ ((k ^ K) & (0u - sel))] = s;
    flags[s] = static_cast<uint8_t>(sel);
    n += sel;
  }
  return n;
}

long partition_packed(const int32_t* order, uint8_t* flags, int32_t* hits, int32_t* nonhit, uint32_t& twice) {
  return partition_scalar(order, flags, hits, nonhit, twice);
}
#endif

// Which rows a step reads: "cold" gives every row of every step its own state and top-k (out of cache,
// as when each layer has its own table); "bench" keeps R state rows and takes a fresh top-k every step
// (what benchmarks/sparse_decode_bench.py times: the state stays in L3); "hot" repeats two rows.
enum class Data { kCold, kBench, kHot };

// The rows that row r of a step reads: its state (slot tokens, order) and its top-k.
struct RowPick {
  int state, topk;
};

RowPick pick_rows(Data data, int step, int r) {
  const int fresh = step * R + r;
  switch (data) {
    case Data::kHot:
      return {r % 2, r % 2};
    case Data::kBench:
      return {r, fresh};
    case Data::kCold:
      break;
  }
  return {fresh, fresh};
}

Phases run(const Rows& rows, Data data, long& sink) {
  std::vector<uint16_t> table(L + 2, 0);
  uint32_t tag = 1;  // 0 marks an entry no row owns
  std::vector<int32_t> hit(K + 1), hits(C + 8), nonhit(C + 8);
  std::vector<uint8_t> flags(C), matched(C);
  Phases best{1e30, 1e30, 1e30, 1e30, 1e30};
  for (int step = 0; step < STEPS; ++step) {
    uint64_t c[5] = {0, 0, 0, 0, 0};
    for (int r = 0; r < R; ++r) {
      const RowPick rp = pick_rows(data, step, r);
      const int32_t* tk = rows.topk[rp.topk].data();
      const int32_t* stt = rows.tokens[rp.state].data();
      const int32_t* order = rows.order[rp.state].data();
      const uint64_t t0 = __rdtsc();
      uint32_t dup = 0;
      const uint32_t tagged = tag << kIndexBits;
      for (int k = 0; k < K; ++k) {
        dup |= static_cast<uint32_t>((table[tk[k]] >> kIndexBits) == tag);
        table[tk[k]] = static_cast<uint16_t>(tagged | k);
      }
      const uint64_t t1 = __rdtsc();
      const long n = match_gather(stt, table.data(), tag, hit.data(), flags.data());
      const uint64_t t2 = __rdtsc();
      std::copy(flags.begin(), flags.end(), matched.begin());  // the scalar partition's input, not timed
      const uint64_t t2b = __rdtsc();
      uint32_t twice = 0;
      const long b = partition_packed(order, flags.data(), hits.data(), nonhit.data(), twice);
      const uint64_t t3 = __rdtsc();
      if (tag == kMaxTag) {  // the next row needs a fresh table
        std::fill(table.begin(), table.end(), 0);
        tag = 0;
      }
      ++tag;
      const uint64_t t4 = __rdtsc();
      uint32_t twice2 = 0;
      const long b2 = partition_scalar(order, matched.data(), hits.data(), nonhit.data(), twice2);
      const uint64_t t5 = __rdtsc();
      c[0] += t1 - t0;
      c[1] += t2 - t1;
      c[2] += t3 - t2b;
      c[3] += t4 - t3;
      c[4] += t5 - t4;
      sink += n + dup + b + b2 + twice + twice2 + hits[0] + nonhit[0];
    }
    const double per = 1.0 / (static_cast<double>(R) * C);
    const Phases p{c[0] * per, c[1] * per, c[2] * per, c[3] * per, c[4] * per};
    if (p.total() < best.total()) {
      best = p;
    }
  }
  return best;
}

// The contract's bare memory operations (see the header), per row: table writes, probes, order marks,
// sequential state and output traffic. Outputs are one set of [R, K] rows reused every step, as in the
// benchmark.
struct ContractPhases {
  double table, probe, marks, io;
  double total() const { return table + probe + marks + io; }
};

volatile int32_t kZero = 0;

ContractPhases run_contract(Rows& rows, Data data, long& sink) {
  std::vector<uint16_t> table(L + 2, 0);
  std::vector<uint8_t> marks(C);
  std::vector<int32_t> slots(static_cast<size_t>(R) * K), miss_tokens(slots.size()), miss_slots(slots.size());
  ContractPhases best{1e30, 1e30, 1e30, 1e30};
  for (int step = 0; step < STEPS; ++step) {
    uint64_t c[4] = {0, 0, 0, 0};
    for (int r = 0; r < R; ++r) {
      const RowPick rp = pick_rows(data, step, r);
      const int32_t* tk = rows.topk[rp.topk].data();
      int32_t* stt = rows.tokens[rp.state].data();
      int32_t* order = rows.order[rp.state].data();
      const uint64_t t0 = __rdtsc();
      for (int k = 0; k < K; ++k) {
        table[tk[k]] = static_cast<uint16_t>(k);
      }
      const uint64_t t1 = __rdtsc();
      uint32_t probed = 0;
      for (int s = 0; s < C; ++s) {
        probed += table[stt[s]];
      }
      const uint64_t t2 = __rdtsc();
      for (int j = 0; j < C; ++j) {
        marks[order[j]] = 1;
      }
      const uint64_t t3 = __rdtsc();
      // the state rewritten in place (adding a zero the compiler cannot see), the outputs written from the
      // top-k row
      const int32_t delta = kZero;
      for (int s = 0; s < C; ++s) {
        stt[s] += delta;
        order[s] += delta;
      }
      int32_t* sl = slots.data() + static_cast<size_t>(r) * K;
      int32_t* mt = miss_tokens.data() + static_cast<size_t>(r) * K;
      int32_t* ms = miss_slots.data() + static_cast<size_t>(r) * K;
      for (int k = 0; k < K; ++k) {
        sl[k] = tk[k];
        mt[k] = tk[k];
        ms[k] = tk[k];
      }
      const uint64_t t4 = __rdtsc();
      c[0] += t1 - t0;
      c[1] += t2 - t1;
      c[2] += t3 - t2;
      c[3] += t4 - t3;
      sink += probed + marks[r] + sl[r] + mt[r + 1] + ms[r + 2];
    }
    const double per = 1.0 / (static_cast<double>(R) * C);
    const ContractPhases p{c[0] * per, c[1] * per, c[2] * per, c[3] * per};
    if (p.total() < best.total()) {
      best = p;
    }
  }
  return best;
}

double tsc_ghz() {
  const auto w0 = std::chrono::steady_clock::now();
  const uint64_t c0 = __rdtsc();
  while (std::chrono::steady_clock::now() - w0 < std::chrono::milliseconds(200)) {
  }
  const uint64_t c1 = __rdtsc();
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - w0).count();
  return static_cast<double>(c1 - c0) / ns;
}

}  // namespace

int main() {
  std::mt19937 rng(0);
  Rows rows = make_rows(STEPS * R, rng);
  const double ghz = tsc_ghz();
  long sink = 0;
  const Phases cold = run(rows, Data::kCold, sink);
  const Phases hot = run(rows, Data::kHot, sink);
  const ContractPhases contract_cold = run_contract(rows, Data::kCold, sink);
  const ContractPhases contract_bench = run_contract(rows, Data::kBench, sink);
  const ContractPhases contract_hot = run_contract(rows, Data::kHot, sink);
  std::printf("residency row floor, R %d K %d C %d (TSC %.3f GHz); cycles per (row, slot), best of %d steps\n",
              R, K, C, ghz, STEPS);
  std::printf("%-6s%8s%8s%11s%8s%8s%8s%18s\n", "data", "fill", "match", "partition", "zero", "total", "ns",
              "scalar partition");
  for (const auto& [name, p] : {std::pair{"cold", cold}, std::pair{"hot", hot}}) {
    std::printf("%-6s%8.2f%8.2f%11.2f%8.2f%8.2f%8.2f%18.2f\n", name, p.fill, p.match, p.partition, p.zero,
                p.total(), p.total() / ghz, p.scalar_partition);
  }
  std::printf("\ncontract: only the memory operations a row implies (table, probes, order marks, state and output I/O), same units\n");
  std::printf("%-6s%8s%8s%8s%8s%8s%8s\n", "data", "table", "probe", "marks", "io", "total", "ns");
  for (const auto& [name, p] :
       {std::pair{"cold", contract_cold}, std::pair{"bench", contract_bench}, std::pair{"hot", contract_hot}}) {
    std::printf("%-6s%8.2f%8.2f%8.2f%8.2f%8.2f%8.2f\n", name, p.table, p.probe, p.marks, p.io, p.total(),
                p.total() / ghz);
  }
  if (FILE* f = std::fopen("benchmarks/results/residency_floor.json", "w")) {
    std::fprintf(f, "{\"tsc_ghz\": %.4f", ghz);
    for (const auto& [name, p] : {std::pair{"cold", cold}, std::pair{"hot", hot}}) {
      std::fprintf(f,
                   ", \"%s\": {\"fill\": %.3f, \"match\": %.3f, \"partition\": %.3f, \"zero\": %.3f, "
                   "\"total_cycles\": %.3f, \"total_ns\": %.3f, \"scalar_partition\": %.3f}",
                   name, p.fill, p.match, p.partition, p.zero, p.total(), p.total() / ghz, p.scalar_partition);
    }
    for (const auto& [name, p] : {std::pair{"contract_cold", contract_cold}, std::pair{"contract_bench", contract_bench},
                                  std::pair{"contract_hot", contract_hot}}) {
      std::fprintf(f,
                   ", \"%s\": {\"table\": %.3f, \"probe\": %.3f, \"marks\": %.3f, \"io\": %.3f, "
                   "\"total_cycles\": %.3f, \"total_ns\": %.3f}",
                   name, p.table, p.probe, p.marks, p.io, p.total(), p.total() / ghz);
    }
    std::fprintf(f, "}\n");
    std::fclose(f);
  }
  return sink == 42 ? 1 : 0;
}
