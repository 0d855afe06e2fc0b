// The C++ wrapper against the installed libkungfu, under kungfu-run: RAII
// session and handles, containers as spans, a fused group, a group of
// ranks (kungfu::comm), exceptions carrying the status. Exits non-zero on the first failure.
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

        // a group of the ranks of this one's parity, in reverse order:
        // group rank i is parity[i]
        {
            std::vector<int> parity;
            for (int r = size - 1; r >= 0; r--)
                if (r % 2 == rank % 2) parity.push_back(r);
            kungfu::comm c(parity);
            const int n = int(parity.size());
            REQUIRE(c.size() == n);
            REQUIRE(parity[std::size_t(c.rank())] == rank);
            std::vector<std::int64_t> one{rank}, sum(1), who(static_cast<std::size_t>(n)), root{rank};
            auto h1 = c.allreduce<std::int64_t>(one, sum, KF_SUM, "cpp/comm/sum");
            auto h2 = c.allgather<std::int64_t>(one, who, "cpp/comm/who");
            h1.wait(60000);
            h2.wait(60000);
            std::int64_t want = 0;
            for (int r : parity) want += r;
            REQUIRE(sum[0] == want);
            for (int i = 0; i < n; i++) REQUIRE(who[std::size_t(i)] == parity[std::size_t(i)]);
            c.broadcast<std::int64_t>(root, 0, "cpp/comm/root").wait(60000);
            REQUIRE(root[0] == parity[0]);
            c.barrier().wait(60000);
        }

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
