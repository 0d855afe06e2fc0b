// The C++ wrapper against the installed libkungfu, under kungfu-run: RAII
// session and handles, containers as spans, a fused group, exceptions
// carrying the status. Exits non-zero on the first failure.
#include <kungfu.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define REQUIRE(cond)                                                                 \
    do {                                                                              \
        if (!(cond)) {                                                                \
            std::fprintf(stderr, "%s:%d: failed: %s\n", __FILE__, __LINE__, #cond); \
            std::exit(1);                                                             \
        }                                                                             \
    } while (0)

int main() {
    try {
        kungfu::session kf;
        const int rank = kf.rank(), size = kf.size();
        REQUIRE(size >= 2);

        // 20 gradients of growing size, each checked exactly
        std::vector<std::vector<float>> grads, sums;
        std::vector<kungfu::handle> hs;
        for (int i = 0; i < 20; i++) {
            std::size_t n = std::size_t(1) << i;
            grads.emplace_back(n, float(rank + i));
            sums.emplace_back(n, 0.0f);
        }
        for (int k = 0; k < 20; k++) {
            int i = (k * 7 + rank * 3) % 20;  // a per-rank order
            hs.push_back(kf.allreduce<float>(grads[i], sums[i], KF_SUM, "cpp/grad/" + std::to_string(i)));
        }
        for (auto &h : hs) h.wait(60000);
        for (int i = 0; i < 20; i++)
            for (float v : sums[i]) REQUIRE(v == float(size * (size - 1) / 2 + size * i));

        // a fused group
        std::vector<std::vector<double>> in(8, std::vector<double>(5)), out(8, std::vector<double>(5));
        std::vector<kungfu::handle> gh;
        {
            kungfu::group g;
            for (int i = 0; i < 8; i++) {
                for (int j = 0; j < 5; j++) in[i][j] = rank + i * j;
                gh.push_back(kf.allreduce<double>(in[i], out[i], KF_SUM, "cpp/fused/" + std::to_string(i)));
            }
            g.end();
        }
        for (auto &h : gh) h.wait(60000);
        for (int i = 0; i < 8; i++)
            for (int j = 0; j < 5; j++) REQUIRE(out[i][j] == size * (size - 1) / 2.0 + size * i * j);

        // broadcast, allgather, barrier
        std::vector<std::int64_t> b(100, rank == 0 ? 42 : 0);
        kf.broadcast<std::int64_t>(b, 0, "cpp/bcast").wait();
        for (auto v : b) REQUIRE(v == 42);
        std::vector<std::int32_t> mine{rank, -rank}, all(2 * size);
        kf.allgather<std::int32_t>(mine, all, "cpp/allgather").wait();
        for (int r = 0; r < size; r++) REQUIRE(all[2 * r] == r && all[2 * r + 1] == -r);
        kf.barrier().wait();

        // errors arrive as exceptions with the status
        bool threw = false;
        try {
            std::vector<float> small(3);
            kf.allreduce<float>(grads[4], small, KF_SUM, "cpp/bad");
        } catch (const kungfu::error &e) {
            threw = e.status() == KF_ERR_INVALID_ARGUMENT;
        }
        REQUIRE(threw);
        threw = false;
        try {
            kf.broadcast<std::int64_t>(b, size + 5, "cpp/bad-root");
        } catch (const kungfu::error &e) {
            threw = e.status() == KF_ERR_INVALID_ARGUMENT && std::string(e.what()).find("root") != std::string::npos;
        }
        REQUIRE(threw);
        std::printf("rank %d: all C++ checks passed\n", rank);
    } catch (const kungfu::error &e) {
        std::fprintf(stderr, "kungfu::error %d: %s\n", e.status(), e.what());
        return 1;
    }
    return 0;
}
