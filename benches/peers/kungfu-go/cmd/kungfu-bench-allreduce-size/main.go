// A sized allreduce benchmark for the original KungFu (Go), for
// benches/peers/go_compare.py: the per-op call of KungFu's own
// tests/go/cmd/kungfu-bench-allreduce (a float32 sum through
// sess.AllReduce), on one buffer of -size bytes instead of a fake model,
// timed between barriers on rank 0, which prints one RESULT line.
package main

import (
	"flag"
	"fmt"
	"time"

	kb "github.com/lsds/KungFu/srcs/go/kungfu/base"
	"github.com/lsds/KungFu/srcs/go/kungfu/peer"
	"github.com/lsds/KungFu/srcs/go/log"
	"github.com/lsds/KungFu/srcs/go/utils"
	"github.com/lsds/KungFu/tests/go/testutils"
)

var (
	size   = flag.Int("size", 1<<20, "buffer size in BYTES (must be a multiple of 4; float32 count = size/4)")
	iters  = flag.Int("iters", 20, "timed allreduce ops")
	warmup = flag.Int("warmup", 3, "untimed warmup ops")
)

func main() {
	flag.Parse()
	if *size%4 != 0 {
		log.Exitf("-size must be a multiple of 4")
	}
	p, err := peer.New()
	if err != nil {
		utils.ExitErr(err)
	}
	p.Start()
	defer p.Close()
	sess := p.CurrentSession()
	rank, np := sess.Rank(), sess.Size()
	count := *size / 4
	send := kb.NewVector(count, kb.F32)
	recv := kb.NewVector(count, kb.F32)
	w := kb.Workspace{SendBuf: send, RecvBuf: recv, OP: kb.SUM, Name: "NegotiatedGrad_0/AllReduce"}
	sess.Barrier()
	for i := 0; i < *warmup; i++ {
		if err := sess.AllReduce(w); err != nil {
			utils.ExitErr(err)
		}
	}
	sess.Barrier()
	t0 := time.Now()
	for i := 0; i < *iters; i++ {
		if err := sess.AllReduce(w); err != nil {
			utils.ExitErr(err)
		}
	}
	d := time.Since(t0)
	if rank == 0 {
		bytes := int64(*size)
		perOp := d.Seconds() / float64(*iters)
		algbw := float64(bytes) / perOp                   // bytes/s
		busbw := algbw * 2 * float64(np-1) / float64(np)  // nccl-tests convention
		kfRate := int64(*iters) * int64(4*(np-1)) * bytes // original benchmark's "workload"
		fmt.Printf("RESULT np=%d bytes=%d floats=%d iters=%d total_s=%.6f per_op_us=%.1f algbw_MiBps=%.2f busbw_MiBps=%.2f kungfu_rate=%s\n",
			np, bytes, count, *iters, d.Seconds(), perOp*1e6, algbw/(1<<20), busbw/(1<<20), testutils.ShowRate(kfRate, d))
	}
}
