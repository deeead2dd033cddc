#!/usr/bin/env bash
# One call on the H200 machine: build, C++ tests (AVX-512 there), GPU tests, then the named
# benchmark stages. Logs go to $OUT (or ./out); a short table is printed last.
#   bash benchmarks/run_h200.sh [stage ...]     stages: build ctest cuda cpu adam memory train deepspeed bench
#                                               profile prefetch_d2h policies sweep_tokens sweep_depth sweep_size (SWEEP_ARGS: extra bench_train flags)
#                                               cuda_new scale_train scale_load scale_lora long_7b long_loss attention
#                                               before_build before_after (BEFORE_COMMIT: the commit in .before/; BA_CLIPS: default "0 1.0";
#                                                 BA_PRESET: a bench_train preset, e.g. 7b or 8b, default 3b; a megatrain:<options> system
#                                                 keeps a grad accumulator unless acc=0 is named: at 8b name it, e.g. megatrain:policy=auto,acc=0,
#                                                 or 18 B/param exceed a 125 GiB host, which this script's MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1 lets through)
#                                               idle_ab (IDLE_TREES, IDLE_REPS, IDLE_SYSTEMS: compute idle per profiled step, trees side by side)
#                                               cuda (CUDA_K: a pytest -k selection of the GPU tests; CUDA_TIMEOUT, default 560 s: the GPU tests took ~390 + 96 s in two processes on 2026-12-03)
#                                               defaults (DEFAULTS_PRESET: wrap(model) with / without Liger vs PyTorch + ckpt with / without Liger, clip 1.0)
#                                               peers (PEERS_PRESET, PEERS_SYSTEMS, PEERS_ARGS, PEERS_TAG, PEERS_CLIP: every system, max_grad_norm 1.0;
#                                                 PEERS_SYSTEMS may name megatrain_official / slideformer: their public source in .peers/<name>
#                                                 (git-ignored: the device call carries .peers), else a skipped row)
#                                               disk (bench_disk.py on the disk under the repository, DISK_ARGS: extra flags)
#                                               disk_train (a 10B Llama, fp32 state 130 GiB > host, the deepest layers' state in
#                                                 the disk tier under DISK_DIR (default build/disk_train): 16K and 64K tokens/step;
#                                                 DISK_TRAIN_ARGS: extra bench_scale.py disk flags, e.g. --host-limit-gib 105)
#                                               clip_tax (CLIP_PRESET, default 8b: wrap(model) with max_grad_norm 1.0, profiled, and without)
#                                               stream_ab (STREAM_PRESET, default 3b: every layer master-streamed, 12 host B/param, vs
#                                                 every layer's compute copy in the host store, 14 B/param; clip 1.0; H2D GB and s/step)
#                                               projection (bench_projection.py --preset paper120b: a few layers of the ~120B shape, projected; PROJ_ARGS)
#                                               pool (the largest Llama of the 14B shape host + GPU hold, as a user gets it: the layer count
#                                                 searched with megatrain.estimate, then built and trained, max_grad_norm 1.0, 4 x 4096 tokens;
#                                                 docs/benchmarks/scale_pool_h200.json; POOL_ARGS: extra bench_scale.py pool flags, e.g. --layers 48)
#                                               sched_ab (SCHED_CLIPS, SCHED_SYSTEMS, SCHED_TIMEOUT: C++ slot pool / fused norms vs the Python path, one call)
#                                               bg_start (BG_CMD: a command longer than one call, in the background) / bg_wait (BG_WAIT:
#                                                 collect it in a later call while the machine is still held)
# BUNDLE=1: $OUT packed into one $OUT/out.tgz at the end (the device tool returns only a few files per call).
# deepspeed: offline install from .whl/ (wheels carried in the working tree; deepspeed itself built with
# DS_BUILD_OPS=0, so its ops JIT-compile here) and a pre-build of the cpu_adam op (DeepSpeed's own g++ flags: the
# host's ISA and OpenMP; no nvcc) into the torch_extensions cache, so bench's deepspeed child does not pay for it.
# bench runs it first when .whl/ exists and deepspeed is not importable.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MEGATRAIN_SKIP_HOST_MEMORY_CHECK=${MEGATRAIN_SKIP_HOST_MEMORY_CHECK:-1}
# only DeepSpeed reads this: accept an nvcc whose CUDA minor differs from torch's (its table stops at 12.x)
export DS_SKIP_CUDA_CHECK=${DS_SKIP_CUDA_CHECK:-1}
# DeepSpeed's JIT-built ops (cpu_adam: ~2-4 min of g++ -O3) go to the git-ignored build/, which the
# device machine keeps between calls, instead of ~/.cache
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(build ctest cuda adam memory)
summary=()
touch "$OUT/.t0"
collect() {  # results written under docs/benchmarks by this call -> $OUT after every stage (a cut-short call keeps them)
  find docs/benchmarks -type f -newer "$OUT/.t0" -exec cp {} "$OUT/" \; 2>/dev/null
}
run() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-8s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-150)")")
  collect
  return $rc
}
ds_install() {  # offline: every wheel deepspeed needs is in .whl/ (torch, numpy are already there)
  # If pip's resolver fails (it re-checks the installed torch's own requirements, which an offline
  # index may not satisfy), install deepspeed and only its missing dependencies with --no-deps:
  # --no-deps leaves an already installed package (any version) as it is.
  run deepspeed bash -c 'if [ -d .whl ]; then
      python3 -m pip install -q --no-index --find-links .whl deepspeed ||
      python3 -m pip install -q --no-index --find-links .whl --no-deps deepspeed einops hjson msgpack ninja \
        packaging psutil py-cpuinfo pydantic pydantic-core annotated-types typing-inspection typing-extensions tqdm nvidia-ml-py
    fi
    python3 -c "import deepspeed, torch; print(\"deepspeed\", deepspeed.__version__, \"torch\", torch.__version__, torch.version.cuda)" &&
    timeout 600 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=True); print(\"cpu_adam op ok\")"'
}
for s in "${stages[@]}"; do
  case $s in
    build)
      run build bash -c 'python3 -m pip install -q --no-deps --no-build-isolation -e . && python3 -c "import megatrain, megatrain._C as C; print(C.build_info())"' || break ;;
    ctest)
      run ctest bash -c 'mkdir -p /tmp/gt && for f in .carry/*.deb; do dpkg -x $f /tmp/gt; done;
        cmake -S . -B build/cmake -G Ninja -DGTest_DIR=/tmp/gt/usr/lib/x86_64-linux-gnu/cmake/GTest \
          -DCMAKE_CXX_FLAGS=-I/tmp/gt/usr/include >/dev/null && cmake --build build/cmake >/dev/null &&
        ctest --test-dir build/cmake 2>&1 | tail -n 5' ;;
    cuda)
      run cuda timeout ${CUDA_TIMEOUT:-560} python3 -m pytest -q -x -s -m cuda tests/python -p no:cacheprovider ${CUDA_K:+-k "$CUDA_K"} ;;
    cpu)
      run cpu python3 -m pytest -q -x tests/python -p no:cacheprovider ;;
    adam)
      run adam timeout 120 python3 benchmarks/bench_cpu_adam.py --steps 3 --out docs/benchmarks --tag h200 ;;
    memory)
      run memory timeout ${MEM_TIMEOUT:-150} python3 benchmarks/bench_memory.py --out docs/benchmarks/memory_depth.json ;;
    train)
      run train timeout ${TRAIN_TIMEOUT:-400} python3 -m megatrain train --config examples/configs/h200_1b.yaml --out /tmp/run1b --no-progress
      cp /tmp/run1b/summary.json "$OUT/train_summary.json" 2>/dev/null; cp /tmp/run1b/metrics.jsonl "$OUT/train_metrics.jsonl" 2>/dev/null ;;
    deepspeed)
      ds_install ;;
    profile)  # one profiled step of megatrain at 3b: stream overlap, idle gaps, host syncs (~2 min)
      run profile timeout 400 python3 benchmarks/bench_train.py --systems megatrain --profile --steps 3 --warmup 1 \
        --out docs/benchmarks/train_3b_profile.json ;;
    prefetch_d2h)  # ratios at 3b in one run: prefetch depth (slots=1: none, 3: two ahead), gradient D2H overlap
      run prefetch_d2h timeout 590 python3 benchmarks/bench_train.py --systems megatrain megatrain:slots=1 megatrain:slots=3 megatrain:d2h=0 \
        --steps 3 --warmup 1 --out docs/benchmarks/train_3b_prefetch_d2h.json ;;
    policies)  # Adam overlap with the next forward, store / auto policies, against GPU-resident PyTorch without checkpointing
      run policies timeout 590 python3 benchmarks/bench_train.py --systems megatrain megatrain:overlap=0 megatrain:policy=store \
        megatrain:policy=auto torch_nockpt torch_ckpt --steps 3 --warmup 1 --out docs/benchmarks/train_3b_policies.json ;;
    sweep_tokens)  # 2K..64K tokens/step at 3b, megatrain + torch_ckpt (~10 min: split with --tokens)
      run sweep_tokens python3 benchmarks/bench_train.py --sweep tokens --steps 3 --warmup 1 ${SWEEP_ARGS:-} \
        --out docs/benchmarks/sweep_tokens.json ;;
    sweep_depth)  # 16..128 layers at 1b width; acc=0 (14 B/param) so that 128 layers (5.6B) fits 125 GiB
      run sweep_depth python3 benchmarks/bench_train.py --sweep depth --systems megatrain:acc=0 --steps 3 --warmup 1 \
        ${SWEEP_ARGS:-} --out docs/benchmarks/sweep_depth.json ;;
    sweep_size)  # Llama 1b/3b/7b/13b; what does not fit the host is recorded as skipped
      run sweep_size python3 benchmarks/bench_train.py --sweep size --systems megatrain:acc=0 --steps 3 --warmup 1 \
        ${SWEEP_ARGS:-} --out docs/benchmarks/sweep_size.json ;;
    cuda_new)  # GPU tests of the drop-in surface and of streamed loading only
      run cuda_new timeout 200 python3 -m pytest -q -x -s -m cuda tests/python/test_drop_in.py tests/python/test_loading.py \
        tests/python/test_long_context.py -p no:cacheprovider ;;
    scale_train)  # Llama-3-8B and 6.74B shapes built straight into the host store, 4 x 4096 tokens, 5 steps
      run scale_train timeout ${SCALE_TIMEOUT:-480} python3 benchmarks/bench_scale.py train ;;
    scale_load)  # a 7B bf16 HF directory written layer by layer, loaded by from_pretrained (pin after / before the fill)
      run scale_load timeout ${SCALE_TIMEOUT:-300} python3 benchmarks/bench_scale.py load --dir /tmp/m7b; rm -rf /tmp/m7b ;;
    scale_lora)  # PEFT LoRA r=16 on q,k,v,o of a frozen ~30B Llama base
      run scale_lora timeout ${SCALE_TIMEOUT:-300} python3 benchmarks/bench_scale.py lora ;;
    long_7b)  # 6.74B at batch 1 x LONG_SEQ tokens (default 262144), one optimizer step
      run long_7b timeout ${LONG_TIMEOUT:-540} python3 benchmarks/bench_long_context.py --preset 7b --seq ${LONG_SEQ:-262144} \
        --out docs/benchmarks/long_context_7b.json ;;
    attention)  # causal SDPA per backend (flash / cuDNN / efficient / torch's default) at ATTN_SEQ tokens, 7b and 1b head shapes
      run attention timeout ${ATTN_TIMEOUT:-240} python3 benchmarks/bench_attention.py --seq ${ATTN_SEQ:-16384 65536 131072} \
        --out docs/benchmarks/attention_h200.json ;;
    long_loss)  # LM head + loss alone at long T: chunked vs full logits vs liger-kernel / cut-cross-entropy (.whl)
      run long_loss bash -c '[ -d .whl ] && python3 -m pip install -q --no-index --no-deps .whl/liger_kernel*.whl .whl/cut_cross_entropy*.whl;
        timeout 240 python3 benchmarks/bench_long_context.py --loss-only --seq 32768 131072 --out docs/benchmarks/long_context_loss.json' ;;
    before_build)  # .before/: `git archive $BEFORE_COMMIT python csrc benchmarks setup.py pyproject.toml CMakeLists.txt`, carried (git-ignored);
                   # BEFORE_DIRS: several such trees (default .before), built in parallel
      run before_build bash -c 'for d in ${BEFORE_DIRS:-.before}; do (cd $d && python3 setup.py build_ext --inplace -q >/dev/null 2>&1 &&
          PYTHONPATH=$PWD/python python3 -c "import megatrain._C; print(\"$d built\")") & done; wait' ;;
    idle_ab)  # compute idle per profiled step, 3.37B, 4 x 4096 tokens, streamed recompute: IDLE_TREES (default ".before ."; "." is
              # this tree, others built by before_build) x IDLE_REPS runs (default 2), alternating; IDLE_SYSTEMS: bench_train systems
              # of this tree (default megatrain); every trace summarised by this tree's compare_idle.py (window and whole-step idle)
      traces=()
      for rep in $(seq ${IDLE_REPS:-2}); do
        for tree in ${IDLE_TREES:-.before .}; do
          for sys in $([ $tree = . ] && echo ${IDLE_SYSTEMS:-megatrain} || echo megatrain); do
            lab=$([ $tree = . ] && echo "${sys#megatrain}" || echo ${tree#.}); lab=${lab:-after}; lab=${lab#:}; lab=${lab//[=,]/_}
            pp=; [ $tree != . ] && pp=$PWD/$tree/python
            rm -rf /tmp/idle_trace && mkdir -p /tmp/idle_trace
            run idle_${lab}_$rep bash -c "cd $tree && PYTHONPATH=$pp timeout 240 python3 benchmarks/bench_train.py --systems $sys \
              --profile --steps 3 --warmup 1 --out /tmp/idle_trace/row.json; cp /tmp/trace_megatrain*.json /tmp/idle_trace/ 2>/dev/null"
            cp /tmp/idle_trace/row.json "$OUT/row_${lab}_$rep.json" 2>/dev/null
            t=$(ls /tmp/idle_trace/trace_*.json 2>/dev/null | head -n 1)
            [ -n "$t" ] && { gzip -c "$t" > "$OUT/trace_${lab}_$rep.json.gz"; traces+=("$lab=$OUT/trace_${lab}_$rep.json.gz"); }
            rm -f /tmp/trace_megatrain*.json
          done
        done
      done
      run idle_compare python3 benchmarks/compare_idle.py --out "$OUT/idle_compare.json" "${traces[@]}"
      cat "$OUT/idle_compare.log" ;;
    before_after)  # 3.37B, 4 x 4096 tokens, .before/ vs this tree, alternating, per max_grad_norm (BA_CLIPS, default "0 1.0")
                   # and per bench_train system (BA_SYSTEMS, default "megatrain": streamed recompute; e.g. "megatrain megatrain:policy=auto")
      for sys in ${BA_SYSTEMS:-megatrain}; do
        lab=${sys//[:=,]/_}
        for clip in ${BA_CLIPS:-0 1.0}; do
          for tree in before after; do
            dir=.; pp=; [ $tree = before ] && { dir=.before; pp=$PWD/.before/python; }
            extra=; [ $clip != 0 ] && extra="--max-grad-norm $clip"
            c=$MEGATRAIN_GIT_COMMIT; [ $tree = before ] && c=${BEFORE_COMMIT:-before}
            run ba_${lab}_${tree}_clip$clip env PYTHONPATH=$pp MEGATRAIN_GIT_COMMIT=$c timeout 240 python3 $dir/benchmarks/bench_train.py \
              --systems $sys --steps 5 --warmup 2 $extra ${BA_PRESET:+--preset $BA_PRESET} \
              --out docs/benchmarks/before_after_${BA_PRESET:+${BA_PRESET}_}${lab}_${tree}_clip$clip.json
          done
        done
      done
      for sys in ${BA_SYSTEMS:-megatrain}; do  # one table per system and max_grad_norm (a failed run: its status)
        for clip in ${BA_CLIPS:-0 1.0}; do
          echo "$sys max_grad_norm=$clip:"
          python3 benchmarks/before_after_sizes.py --system $sys --clip $clip --presets "${BA_PRESET:-}"
        done
      done
      ;;
    sched_ab)  # 3.37B, 4 x 4096 tokens, in one call per max_grad_norm (SCHED_CLIPS, default "0 1.0"): the C++ slot pool and
               # copies + fused norms (megatrain) against the Python slot path (cslots=0) and both before switches; one profiled step each
      for clip in ${SCHED_CLIPS:-0 1.0}; do
        extra=; [ $clip != 0 ] && extra="--max-grad-norm $clip"
        run sched_ab_clip$clip timeout ${SCHED_TIMEOUT:-590} python3 benchmarks/bench_train.py \
          --systems ${SCHED_SYSTEMS:-megatrain megatrain:cslots=0 megatrain:cslots=0,fusednorm=0} --steps 3 --warmup 1 --profile $extra \
          --out docs/benchmarks/train_3b_sched_ab_clip$clip.json
      done ;;
    disk_train)  # plan printed first; disk bandwidth, build, 1 warm-up + 2 timed steps at 16K and at 64K tokens (~5 min)
      run disk_train timeout ${DISK_TRAIN_TIMEOUT:-590} python3 benchmarks/bench_scale.py disk \
        --dir "${DISK_DIR:-$PWD/build/disk_train}" --timeout 570 ${DISK_TRAIN_ARGS:-}
      rm -rf "${DISK_DIR:-$PWD/build/disk_train}/megatrain_tier" ;;
    clip_tax)  # the clipping tax at CLIP_PRESET (default 8b: 8.47B, built straight into the host store): wrap(model) as a
               # user gets it (Liger-Kernel when installed), max_grad_norm 1.0 with one profiled step, then without clipping
      for clip in 1.0 0; do
        extra=; [ $clip != 0 ] && extra="--max-grad-norm $clip --profile"
        run clip_tax_clip$clip timeout ${CLIP_TIMEOUT:-280} python3 benchmarks/bench_train.py --preset ${CLIP_PRESET:-8b} \
          --systems megatrain:policy=default --steps 3 --warmup 1 $extra \
          --out docs/benchmarks/clip_tax_${CLIP_PRESET:-8b}_clip${clip}_h200.json
      done ;;
    stream_ab)  # the 12 B/param host layout against the 14 B/param one, same call: STREAM_PRESET (default 3b), clip 1.0;
                # every layer master-streamed (hcc=0: fp32 masters H2D, cast on the GPU) vs every layer's bf16 compute
                # copy in the host store (hcc=1), both as wrap(model) places them and both with every layer streamed
      run stream_ab timeout ${STREAM_TIMEOUT:-590} python3 benchmarks/bench_train.py --preset ${STREAM_PRESET:-3b} --max-grad-norm 1.0 \
        --steps 3 --warmup 1 --systems megatrain:policy=default,hcc=1 megatrain:policy=default,hcc=0 \
        megatrain:policy=recompute,devstate=0,hcc=1 megatrain:policy=recompute,devstate=0,hcc=0 \
        --out docs/benchmarks/stream_ab_${STREAM_PRESET:-3b}_h200.json ;;
    projection)  # the paper's ~120B Llama shape: a few of its layers trained here, the whole model's step projected
                 # from them (bench_projection.py; PROJ_ARGS: extra flags); docs/benchmarks/projection_paper120b_h200.*
      run projection timeout ${PROJ_TIMEOUT:-590} python3 benchmarks/bench_projection.py --preset paper120b \
        --out docs/benchmarks/projection_paper120b_h200.json ${PROJ_ARGS:-} ;;
    pool)  # search (~10 s), build straight into the host store, 1 warm-up + 3 timed steps; JSON + PNG
      run pool timeout ${POOL_TIMEOUT:-590} python3 benchmarks/bench_scale.py pool --timeout 560 ${POOL_ARGS:-} ;;
    disk)  # sequential disk bandwidth through DiskTier (1/2/4/8 I/O threads) and dd O_DIRECT (< 60 s)
      run disk timeout 120 python3 benchmarks/bench_disk.py --dir "$PWD/build" --out docs/benchmarks/disk_h200 ${DISK_ARGS:-} ;;
    peers)  # every system at PEERS_PRESET (default 3b) with max_grad_norm PEERS_CLIP (default 1.0, the trainers' default;
            # 0: no clipping); PEERS_ARGS: extra bench_train flags (e.g. --grad-accum 4), PEERS_SYSTEMS: the systems,
            # PEERS_TAG: the JSON's name. 2 warm-up steps (here and in defaults): wrap(model)'s planner places again
            # from the first step's measurements, so its second step moves layers' state to the GPU (6.74B, H200:
            # 1.670 s against 1.445 after), as DeepSpeed ZeRO-3's first steps run slower (3.37B: 4.14 s, then 2.48)
      systems=${PEERS_SYSTEMS:-megatrain:policy=auto torch_ckpt torch_nockpt deepspeed_zero2 deepspeed_zero3 fsdp2_offload}
      case " $systems " in *deepspeed*)  # only when a DeepSpeed row is asked for (the install takes ~1 min)
        if [ -d .whl ] && ! python3 -c "import deepspeed" >/dev/null 2>&1; then ds_install; fi ;;
      esac
      # Peers from their own source (benchmarks/peers/): megatrain_official is pure Python (no build; it takes
      # DeepSpeedCPUAdam when deepspeed is importable, as its trainer does, else torch AdamW). slideformer
      # JIT-builds its CPU Adam with g++ on first use (~/.cache/oom_optimizer): built here first, so that the
      # bench child does not pay for it; its benchmark runs with liger-kernel by default, installed from .whl/
      # when the wheel is there (SLIDEFORMER_LIGER=0: without).
      case " $systems " in *" slideformer "*)
        if [ -f .peers/slideformer/offload_transformer.py ]; then
          ls .whl/liger_kernel*.whl >/dev/null 2>&1 && [ "${SLIDEFORMER_LIGER:-auto}" != 0 ] &&
            python3 -m pip install -q --no-index --no-deps .whl/liger_kernel*.whl
          # SlideFormer's loss calls liger-kernel < 0.8 (see benchmarks/peers/slideformer.py): a wheel of one in
          # .peers/_wheels goes to build/slideformer_site, first on the slideformer child's path only
          if ls .peers/_wheels/liger_kernel-0.[67]*.whl >/dev/null 2>&1; then
            python3 -m pip install -q --no-index --no-deps --upgrade --target build/slideformer_site .peers/_wheels/liger_kernel-0.[67]*.whl &&
              export SLIDEFORMER_SITE=$PWD/build/slideformer_site
          fi
          run slideformer_build timeout 600 python3 -c "import sys; sys.path.insert(0, '.peers/slideformer')
from optimizer.layer_adam.builder import CPUAdamLoader; CPUAdamLoader().load(); print('slideformer cpu_adam built')"
        fi ;;
      esac
      clip=${PEERS_CLIP:-1.0}; clipflag=; [ "$clip" != 0 ] && clipflag="--max-grad-norm $clip"
      tag=${PEERS_TAG:-${PEERS_PRESET:-3b}_clip$([ "$clip" = 0 ] && echo 0)}
      run peers_$tag timeout ${PEERS_TIMEOUT:-590} python3 benchmarks/bench_train.py --preset ${PEERS_PRESET:-3b} \
        --systems $systems $clipflag --steps 3 --warmup 2 ${PEERS_ARGS:-} --out docs/benchmarks/peers_$tag.json ;;
    defaults)  # megatrain as a user gets it (wrap(model): no placement option) with and without Liger-Kernel, against
               # PyTorch + checkpointing with and without Liger, at DEFAULTS_PRESET (default 3b), max_grad_norm 1.0, one call;
               # liger-kernel installed offline from .whl/liger_kernel*.whl (pip download --no-deps liger-kernel) when missing
      if ! python3 -c "import liger_kernel" >/dev/null 2>&1; then
        ls .whl/liger_kernel*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps .whl/liger_kernel*.whl
      fi
      run defaults_${DEFAULTS_PRESET:-3b} timeout ${DEFAULTS_TIMEOUT:-590} python3 benchmarks/bench_train.py \
        --preset ${DEFAULTS_PRESET:-3b} --systems megatrain:policy=default megatrain:policy=default,liger=0 torch_ckpt \
        torch_ckpt:liger=1 --max-grad-norm 1.0 --steps 3 --warmup 2 \
        --out docs/benchmarks/defaults_${DEFAULTS_PRESET:-3b}_clip_h200.json ;;
    bg_start)  # BG_CMD in the background (its own session), for work longer than one call (a 6.74B step at 512K
               # tokens: an estimated ~15 min); its log, exit code and any files it writes under build/bg/ stay on the machine while
               # it is held. Write results under build/bg/ (e.g. --out build/bg/long_context_7b.json), not docs/.
      rm -rf build/bg && mkdir -p build/bg
      setsid nohup bash -c "$BG_CMD; echo \$? > build/bg/rc" > build/bg/bg.log 2>&1 < /dev/null &
      echo $! > build/bg/pid
      summary+=("bg_start pid $(cat build/bg/pid): $BG_CMD") ;;
    bg_wait)  # in a later call on the still-held machine: wait up to BG_WAIT s (default 540) for bg_start's command,
              # then copy build/bg/* to $OUT (a command still running is left running)
      t0=$(date +%s)
      while [ -f build/bg/pid ] && [ ! -f build/bg/rc ] && [ $(( $(date +%s) - t0 )) -lt ${BG_WAIT:-540} ]; do sleep 5; done
      cp -r build/bg/. "$OUT/" 2>/dev/null
      summary+=("bg_wait rc=$(cat build/bg/rc 2>/dev/null || echo running) $(( $(date +%s) - t0 ))s  $(tail -n 1 build/bg/bg.log 2>/dev/null | cut -c1-150)") ;;
    bench)
      if [ -d .whl ] && ! python3 -c "import deepspeed" >/dev/null 2>&1; then ds_install; fi
      run bench python3 benchmarks/bench_train.py --out docs/benchmarks/train_3b.json ;;
  esac
done
collect
if [ "${BUNDLE:-0}" = 1 ]; then  # the device tool returns only a few files per call: everything in $OUT as one out.tgz
  tar czf /tmp/out.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/out.tgz "$OUT/out.tgz"
fi
echo "==== summary"; printf '%s\n' "${summary[@]}"
