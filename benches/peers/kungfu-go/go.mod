module kfbench

go 1.19

require github.com/lsds/KungFu v0.0.0

// go_compare.py points this at a checkout of lsds/KungFu
replace github.com/lsds/KungFu => ../src
