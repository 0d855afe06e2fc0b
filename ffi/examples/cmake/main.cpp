// Averages a "gradient" over every worker with the C++ wrapper.
#include <kungfu.hpp>

#include <cstdio>
#include <vector>

int main() {
    kungfu::session kf;
    std::vector<float> grad(1024, float(kf.rank() + 1)), avg(1024);
    kf.allreduce<float>(grad, avg, KF_AVG, "example/grad").wait();
    const float want = (kf.size() + 1) / 2.0f;
    for (float v : avg) {
        if (v != want) {
            std::fprintf(stderr, "rank %d: got %g, expected %g\n", kf.rank(), v, want);
            return 1;
        }
    }
    std::printf("rank %d of %d: average %g\n", kf.rank(), kf.size(), avg[0]);
    return 0;
}
