// Layout test of csrc/amx_path.h on emulated tiles (NA_AMX_EMULATE), run by test_amx.py on
// any CPU: qk_block, interleave_values and pv_block against double-precision references,
// over every shape the rows path gives them (head dims 32..128, 16 or 32 lanes, 16 or 32
// keys, keys in place, scattered or broken mid-tile, 1..16 weight pairs).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "amx_path.h"

static uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);  // truncation: the inputs are bf16 values already
}
static float from_bf16(uint16_t x) { return na_amx::emu_bf16(x); }

static std::mt19937 rng(7);
static uint16_t rnd() {
  std::uniform_real_distribution<float> d(-2.0f, 2.0f);
  return to_bf16(d(rng));
}

static int fails = 0, ran = 0;
static void check(bool ok, const char* what, int a, int b, int c, int d) {
  ++ran;
  if (!ok && fails++ < 10) std::printf("FAIL %s %d %d %d %d\n", what, a, b, c, d);
}

int main() {
  const na_amx::TileConfig cfg = na_amx::full_config();
  na_amx::tile_config(&cfg);
  for (int D : {32, 64, 96, 128}) {
    for (int Rp : {16, 32}) {
      for (int nt : {16, 32}) {
        for (int direct = 0; direct < 3; ++direct) {
          // q^T pairs [D / 2][Rp] and the q rows they hold.
          std::vector<uint16_t> q(size_t(Rp) * D);
          for (auto& x : q) x = rnd();
          std::vector<uint32_t> qp(size_t(D / 2) * Rp);
          for (int cp = 0; cp < D / 2; ++cp)
            for (int r = 0; r < Rp; ++r)
              qp[size_t(cp) * Rp + r] = uint32_t(q[size_t(r) * D + 2 * cp]) |
                                        uint32_t(q[size_t(r) * D + 2 * cp + 1]) << 16;
          // A "cache" of 3 * 32 slots, 3 heads per slot (stride 3 D): keys in place
          // (direct = 1: consecutive slots), scattered (0), or consecutive with one break (2).
          const int64_t kstride = 3 * int64_t(D);
          std::vector<uint16_t> cache(size_t(96) * kstride);
          for (auto& x : cache) x = rnd();
          const uint16_t* kr[32];
          for (int t = 0; t < 32; ++t) {
            int slot = direct == 1 ? 5 + t : direct == 0 ? (t * 37) % 96 : (t < 9 ? 40 + t : 7 + t);
            kr[t] = cache.data() + slot * kstride + D;  // head 1
          }
          std::vector<unsigned char> scratch(na_amx::scratch_bytes(D, 128));
          na_amx::Scratch sc;
          sc.kpack = reinterpret_cast<uint16_t*>(scratch.data());
          sc.vv = reinterpret_cast<uint32_t*>(sc.kpack + 32 * D);
          sc.pa = sc.vv + 128 * 16;
          std::vector<float> s(size_t(32) * Rp, -7.0f);
          na_amx::qk_block(qp.data(), Rp, D, kr, nt, kstride, sc, s.data());
          bool ok = true;
          for (int t = 0; t < 32; ++t) {
            for (int r = 0; r < Rp; ++r) {
              const float got = s[size_t(t) * Rp + r];
              if (t >= nt) {
                ok = ok && got == -7.0f;  // untouched past nt
                continue;
              }
              double ref = 0.0;
              for (int c = 0; c < D; ++c)
                ref += double(from_bf16(q[size_t(r) * D + c])) * from_bf16(kr[t][c]);
              ok = ok && std::fabs(got - ref) <= 1e-4 * (1.0 + std::fabs(ref));
            }
          }
          check(ok, "qk_block", D, Rp, nt, direct);
        }
      }
    }
  }
  for (int Dv : {32, 64, 96, 128}) {
    for (int Rp : {16, 32}) {
      for (int npairs = 1; npairs <= 16; ++npairs) {
        std::vector<uint16_t> v(size_t(32) * Dv);
        for (auto& x : v) x = rnd();
        const uint16_t* vr[33];
        for (int t = 0; t < 32; ++t) vr[t] = v.data() + size_t((t * 7) % 32) * Dv;
        // weights [key][lane] as bf16, as pairs pb[tp][lane]
        std::vector<uint16_t> p(size_t(32) * Rp);
        for (auto& x : p) x = rnd();
        std::vector<uint32_t> pb(size_t(16) * Rp, 0xdeadbeefu);
        for (int tp = 0; tp < npairs; ++tp)
          for (int r = 0; r < Rp; ++r)
            pb[size_t(tp) * Rp + r] =
                uint32_t(p[size_t(2 * tp) * Rp + r]) | uint32_t(p[size_t(2 * tp + 1) * Rp + r]) << 16;
        std::vector<float> acc(size_t(Rp) * Dv);
        for (size_t i = 0; i < acc.size(); ++i) acc[i] = float(i % 13) - 6.0f;
        const std::vector<float> acc0 = acc;
        std::vector<unsigned char> scratch(na_amx::scratch_bytes(128, Dv));
        na_amx::Scratch sc;
        sc.kpack = reinterpret_cast<uint16_t*>(scratch.data());
        sc.vv = reinterpret_cast<uint32_t*>(sc.kpack + 32 * 128);
        sc.pa = sc.vv + size_t(Dv) * 16;
        na_amx::interleave_values(vr, npairs, Dv, sc.vv);
        na_amx::pv_block(acc.data(), Rp, Dv, pb.data(), npairs, sc);
        bool ok = true;
        for (int r = 0; r < Rp; ++r) {
          for (int pos = 0; pos < Dv; ++pos) {
            // position pos of the accumulator holds column col (pv_rows_bf16's order)
            const int c = pos / 32 * 32, j = pos % 16, h = pos % 32 / 16;
            const int col = c + (j / 4) * 8 + 4 * h + j % 4;
            double ref = acc0[size_t(r) * Dv + pos];
            for (int t = 0; t < 2 * npairs; ++t)
              ref += double(from_bf16(p[size_t(t) * Rp + r])) * from_bf16(vr[t][col]);
            const float got = acc[size_t(r) * Dv + pos];
            ok = ok && std::fabs(got - ref) <= 1e-4 * (1.0 + std::fabs(ref));
          }
        }
        check(ok, "pv_block", Dv, Rp, npairs, 0);
      }
    }
  }
  na_amx::tile_release();
  std::printf("ran %d failed %d\n", ran, fails);
  return fails ? 1 : 0;
}
