// Validates rendered Kubernetes manifests offline (scripts/validate-deploy.sh
// renders every kustomization and calls this). Checks, per document:
//   1. schema: built-in kinds against the Kubernetes OpenAPI schemas shipped by
//      kubernetes-models (types, required fields, formats, enums);
//      LeaderWorkerSet against moe-ep's own schema (deploy/schemas) with ajv,
//      and the Kubernetes parts inside it (metadata, the pod templates), which
//      that schema marks with x-moe-ep-kubernetes, against kubernetes-models
//      like a built-in kind; any other apiVersion/kind is an error (nothing
//      may pass unvalidated);
//   2. unknown fields (the API server's strict field validation): built-in
//      kinds and the x-moe-ep-kubernetes parts of custom resources through
//      the TypeScript checker and kubernetes-types (excess property errors
//      only; types are step 1's), the levels a custom resource owns through
//      its schema's additionalProperties: false;
//   3. commands: every flag passed to moe-ep-worker / moe-ep (directly, in a
//      `sh -c` script, or in an exec probe) exists in that binary's help
//      (moe-ep-worker --help; moe-ep [SUB] --help; an underscore spelling of a
//      worker flag is reported as deprecated), every environment
//      variable a container sets is used by its command, named in a binary's
//      help, or listed in library-env.json with the library that reads it,
//      and every $(VAR), $VAR, ${VAR} and $((VAR)) is defined;
//   4. probes: gRPC probe services are "" or a service of proto/*.proto, and
//      a gRPC probe's port is the worker's --health-listen port (else its
//      --listen port, which must then be plaintext) when that is literal;
//      exec probes that call a TLS worker with moe-ep pass --tls-ca (and
//      --tls-cert for mutual TLS), except `moe-ep health`, which is plaintext;
//   4a. probe semantics (server/health.h, issue 8): startup and liveness
//      probes ask the liveness name "" (SERVING while the process serves),
//      never the group-following readiness name "moe_ep.v1.Worker" (a pod not
//      yet joined, or whose group broke, would be restarted); readiness probes
//      ask "moe_ep.v1.Worker"; exec probes use `moe-ep health` on a loopback
//      address (no DNS, no certificate), never `moe-ep status`;
//      the coordinator (`moe-ep coordinator`) likewise, with its readiness
//      name "moe_ep.v1.Coordinator", on its --health-listen port;
//   4b. transport security: a worker listening on a non-loopback address
//      serves TLS or passes --allow-insecure (else it exits at start-up);
//   4c. the coordinator's desired state: every ConfigMap key named
//      desired-state.json passes `moe-ep coordinator --state FILE --check`
//      (the proto3 JSON of moe_ep.v1.DesiredState, validated as the
//      coordinator would at start-up: fields, model, layers, experts >= ranks);
//   5. DESIGN §12: an NCCL worker has NCCL_NVLS_ENABLE=0; one on the host
//      network also has NCCL_HOSTID from spec.nodeName, host IPC and IPC_LOCK;
//   6. Pod Security "restricted" (issue 31 item 6), on every pod template:
//      automountServiceAccountToken false, seccompProfile RuntimeDefault (or
//      Localhost), runAsNonRoot and a non-zero runAsUser, and per container
//      allowPrivilegeEscalation false, capabilities.drop ALL (add at most
//      NET_BIND_SERVICE), not privileged; no host network / PID / IPC, host
//      ports or hostPath volumes. A pod annotated moe-ep/pod-security:
//      privileged (the GPU workers: host network, IPC_LOCK as uid 0) may break
//      the last rules and the root rules, never the others; a pod annotated so
//      that meets "restricted" is told to drop the annotation;
//   7. labels: every object, pod template and selector carries
//      app.kubernetes.io/name and app.kubernetes.io/instance (the object's
//      own), so two installations never select each other's pods;
//   8. a PodDisruptionBudget of the same render selects the pods of every
//      workload that runs moe-ep-worker;
//   9. metrics: every moe-ep-worker and `moe-ep coordinator` serves
//      --metrics-listen; off the host network its port is a declared
//      containerPort named metrics* and the pod is annotated
//      prometheus.io/scrape "true" (prometheus.io/port, when given, one of
//      those ports; without it every declared port is named metrics*, as
//      Prometheus' kubernetes-pods job then scrapes each); on the host
//      network (no declared ports) it carries no prometheus.io annotation;
//  10. one group size: a desired state's headless_service.replicas equals
//      the spec.replicas of the StatefulSet serving that Service in the same
//      render; in a LeaderWorkerSet no container sets a *GROUP_SIZE* or LWS_*
//      variable of its own (LWS_GROUP_SIZE, LWS_WORKER_INDEX and
//      LWS_LEADER_ADDRESS come from the controller), and a coordinator there
//      derives its targets from LWS_LEADER_ADDRESS and LWS_GROUP_SIZE.
//
// Usage: node validate-manifests.mjs --worker BIN --cli BIN --proto-dir DIR
//          --schemas DIR RENDERED.yaml...
// Exit status 0 when every document passes; 1 with one line per problem
// ("FILE: KIND/NAME: what, where") otherwise; 2 on a usage error.

import { execFileSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

import Ajv from "ajv";
import ts from "typescript";
import YAML from "yaml";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const BINARIES = ["moe-ep-worker", "moe-ep"];
// deploy/Dockerfile*: ENTRYPOINT ["moe-ep-worker"], so a container of a moe-ep
// image without a command runs the worker.
const IMAGE_ENTRYPOINT = ["moe-ep-worker"];
const SHELLS = ["sh", "bash", "dash"];
// Set by the container runtime in every container.
const RUNTIME_ENV = new Set(["HOSTNAME", "HOME", "PATH", "PWD"]);
// Set by the LWS controller in every container of a LeaderWorkerSet
// (kubernetes-sigs/lws, api/leaderworkerset/v1: LwsLeaderAddress,
// LwsGroupSize, LwsWorkerIndex).
const LWS_ENV = new Set(["LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"]);

// ---- arguments --------------------------------------------------------------

function parseArgs(argv) {
  const opts = { files: [] };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    const m = a.match(/^--(worker|cli|proto-dir|schemas)$/);
    if (m) {
      if (i + 1 >= argv.length) usage(`${a} needs a value`);
      opts[m[1]] = argv[++i];
    } else if (a.startsWith("--")) {
      usage(`unknown option ${a}`);
    } else {
      opts.files.push(a);
    }
  }
  for (const k of ["worker", "cli", "proto-dir", "schemas"]) {
    if (!opts[k]) usage(`--${k} is required`);
  }
  if (opts.files.length === 0) usage("no rendered manifests given");
  return opts;
}

function usage(message) {
  console.error(`validate-manifests: ${message}`);
  console.error(
    "usage: node validate-manifests.mjs --worker BIN --cli BIN --proto-dir DIR --schemas DIR RENDERED.yaml...",
  );
  process.exit(2);
}

// ---- the binaries' help -----------------------------------------------------

function runHelp(binary, args) {
  try {
    return execFileSync(binary, args, { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
  } catch (e) {
    // A binary that exits non-zero after printing its help: the text is still the help.
    if (typeof e.stdout === "string" && e.stdout.length > 0) return e.stdout + (e.stderr ?? "");
    throw new Error(`cannot run ${binary} ${args.join(" ")}: ${e.message}`);
  }
}

function longFlags(text) {
  const flags = new Set();
  for (const m of text.matchAll(/(?:^|[\s,\[])--([A-Za-z0-9][A-Za-z0-9_-]*)/gm)) flags.add(m[1]);
  return flags;
}

function loadHelp(workerBin, cliBin) {
  // Both binaries use CLI11: --help lists every flag (the worker's hidden
  // underscore aliases of earlier releases excepted).
  const workerText = runHelp(workerBin, ["--help"]);
  const workerFlags = longFlags(workerText);
  if (workerFlags.size === 0) throw new Error(`${workerBin} --help lists no flags`);

  const cliText = runHelp(cliBin, ["--help"]);
  const sub = cliText.split(/^subcommands:\s*$/im)[1] ?? "";
  const subcommands = new Map();
  for (const m of sub.matchAll(/^ {2}([a-z][a-z0-9-]*)\s/gm)) {
    const text = runHelp(cliBin, [m[1], "--help"]);
    subcommands.set(m[1], { text, flags: longFlags(text) });
  }
  if (subcommands.size === 0) throw new Error(`${cliBin} --help lists no subcommands`);
  return {
    "moe-ep-worker": { text: workerText, flags: workerFlags, bool: workerText },
    "moe-ep": { text: cliText, flags: longFlags(cliText), subcommands },
  };
}

// ---- a small POSIX shell reader: words and simple commands ------------------

// Splits a script into simple commands (arrays of words). Quotes are kept
// out of word values; $(...), $((...)) and `...` stay inside one word.
export function shellCommands(script) {
  const text = script.replace(/\\\n/g, " ");
  const commands = [];
  let words = [];
  let word = null;
  let depth = 0;  // nesting of $( ( inside a word
  let quote = null;
  const endWord = () => {
    if (word !== null) words.push(word);
    word = null;
  };
  const endCommand = () => {
    endWord();
    if (words.length > 0) commands.push(words);
    words = [];
  };
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (quote === "'") {
      if (c === "'") quote = null;
      else word += c;
      continue;
    }
    if (quote === '"') {
      if (c === "\\" && i + 1 < text.length) word += text[++i];
      else if (c === '"') quote = null;
      else word += c;
      continue;
    }
    if (depth > 0) {
      word += c;
      if (c === "(") depth++;
      else if (c === ")") depth--;
      continue;
    }
    if (c === "'" || c === '"') {
      if (word === null) word = "";
      quote = c;
    } else if (c === "$" && text[i + 1] === "(") {
      if (word === null) word = "";
      word += "$(";
      i++;
      depth = 1;
    } else if (c === "#" && word === null) {
      while (i < text.length && text[i] !== "\n") i++;
      endCommand();
    } else if (c === "\n" || c === ";" || c === "|" || c === "&") {
      endCommand();
    } else if (c === " " || c === "\t") {
      endWord();
    } else {
      if (word === null) word = "";
      word += c;
    }
  }
  endCommand();
  return commands;
}

const PREFIX_WORDS = new Set(["exec", "then", "do", "else", "elif", "if", "while", "until", "!", "time", "nohup", "{"]);

// Invocations of our binaries in a script: {bin, args}.
function scriptInvocations(script) {
  const found = [];
  for (const words of shellCommands(script)) {
    let i = 0;
    while (i < words.length && (PREFIX_WORDS.has(words[i]) || /^[A-Za-z_][A-Za-z0-9_]*=/.test(words[i]))) i++;
    if (i < words.length && BINARIES.includes(path.basename(words[i]))) {
      found.push({ bin: path.basename(words[i]), args: words.slice(i + 1) });
    }
  }
  return found;
}

// argv of a container or exec probe -> {invocations, scripts}.
function argvInvocations(argv) {
  if (argv.length === 0) return { invocations: [], scripts: [] };
  const head = path.basename(argv[0]);
  if (SHELLS.includes(head)) {
    const c = argv.indexOf("-c");
    if (c >= 0 && c + 1 < argv.length) {
      return { invocations: scriptInvocations(argv[c + 1]), scripts: [argv[c + 1]] };
    }
    return { invocations: [], scripts: [] };
  }
  if (BINARIES.includes(head)) return { invocations: [{ bin: head, args: argv.slice(1) }], scripts: [] };
  return { invocations: [], scripts: [] };
}

// Variables a script assigns itself (NAME=..., for NAME in, read NAME).
function scriptAssigned(script) {
  const names = new Set();
  for (const m of script.matchAll(/(?:^|[\s;&|(])([A-Za-z_][A-Za-z0-9_]*)=/g)) names.add(m[1]);
  for (const m of script.matchAll(/\bfor\s+([A-Za-z_][A-Za-z0-9_]*)\s+in\b/g)) names.add(m[1]);
  for (const m of script.matchAll(/\bread\s+(?:-r\s+)?([A-Za-z_][A-Za-z0-9_]*)/g)) names.add(m[1]);
  return names;
}

// Variables a script reads: $NAME, ${NAME...}, and bare names inside $((...)).
function scriptReads(script) {
  const names = new Set();
  const body = script.replace(/^\s*#.*$/gm, "");
  for (const m of body.matchAll(/\$\{?([A-Za-z_][A-Za-z0-9_]*)/g)) names.add(m[1]);
  for (const m of body.matchAll(/\$\(\(([^]*?)\)\)/g)) {
    for (const id of m[1].matchAll(/(?<![$\w])([A-Za-z_][A-Za-z0-9_]*)/g)) names.add(id[1]);
  }
  return names;
}

// ---- schema validation --------------------------------------------------------

const modelCache = new Map();
async function modelClass(apiVersion, kind) {
  const key = `${apiVersion}/${kind}`;
  if (!modelCache.has(key)) {
    const modulePath = apiVersion.includes("/") ? apiVersion : `v1`;
    const spec = `kubernetes-models/${modulePath}/${kind}`;
    let cls = null;
    try {
      cls = (await import(spec))[kind] ?? null;
    } catch {
      cls = null;
    }
    modelCache.set(key, cls);
  }
  return modelCache.get(key);
}

// Custom resource schemas (deploy/schemas/*.json with x-moe-ep-kind). Their
// keyword x-moe-ep-kubernetes {models, types, type} marks a Kubernetes-owned
// value: ajv checks it with the kubernetes-models class of module `models`
// and records it in `typedParts` for the unknown-field check against
// kubernetes-types' `types` module, type `type`. The schemas state
// additionalProperties themselves; ajv runs in strict mode so that a keyword
// misspelt in a schema is an error rather than silently ignored.
const typedParts = [];

function kubernetesKeywordValues(schema, out = []) {
  if (Array.isArray(schema)) schema.forEach((s) => kubernetesKeywordValues(s, out));
  else if (schema !== null && typeof schema === "object") {
    for (const [k, v] of Object.entries(schema)) {
      if (k === "x-moe-ep-kubernetes") out.push(v);
      else kubernetesKeywordValues(v, out);
    }
  }
  return out;
}

async function loadCrdValidators(schemaDir) {
  const models = new Map();
  const ajv = new Ajv({ allErrors: true, strict: true, validateFormats: false });
  ajv.addKeyword({ keyword: "x-moe-ep-kind", schemaType: "object" });
  ajv.addKeyword({
    keyword: "x-moe-ep-kubernetes",
    schemaType: "object",
    metaSchema: {
      type: "object",
      required: ["models", "types", "type"],
      additionalProperties: false,
      properties: { models: { type: "string" }, types: { type: "string" }, type: { type: "string" } },
    },
    errors: true,
    validate: function kubernetesPart(ref, data, _parentSchema, cxt) {
      const where = cxt?.instancePath ?? "";
      kubernetesPart.errors = [];
      // Not an object: the schema's own `type: object` reports it.
      if (data === null || typeof data !== "object" || Array.isArray(data)) return true;
      typedParts.push({ value: data, types: ref.types, type: ref.type, where });
      try {
        new (models.get(ref.models))(data).validate();
      } catch (e) {
        if (!Array.isArray(e.errors)) throw e;
        for (const err of e.errors) {
          kubernetesPart.errors.push({
            keyword: "x-moe-ep-kubernetes",
            instancePath: where + err.instancePath,
            params: {},
            message: `${err.message} (Kubernetes ${ref.type})`,
          });
        }
      }
      return kubernetesPart.errors.length === 0;
    },
  });
  const validators = new Map();
  for (const f of fs.readdirSync(schemaDir).filter((f) => f.endsWith(".json"))) {
    const schema = JSON.parse(fs.readFileSync(path.join(schemaDir, f), "utf8"));
    const id = schema["x-moe-ep-kind"];
    if (!id) continue;
    for (const ref of kubernetesKeywordValues(schema)) {
      if (models.has(ref.models)) continue;
      const cls = (await import(ref.models))[ref.type];
      if (typeof cls !== "function") throw new Error(`${f}: ${ref.models} exports no ${ref.type}`);
      models.set(ref.models, cls);
    }
    validators.set(`${id.apiVersion}/${id.kind}`, ajv.compile(schema));
  }
  return validators;
}

function ajvMessage(e) {
  if (e.keyword === "additionalProperties") return `${e.instancePath || "/"}: unknown field "${e.params.additionalProperty}"`;
  return `${e.instancePath || "/"}: ${e.message}`;
}

// kubernetes-types modules by API group: "" -> core, "apps" -> apps,
// "networking.k8s.io" -> networking.
function typesModule(apiVersion) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["core", apiVersion];
  return `kubernetes-types/${group.split(".")[0]}/${version}`;
}

// An object literal of `value` whose leaves are `as any`: TypeScript still
// checks every object for excess properties, but reports no type mismatch,
// which would end its checking of the enclosing literal (kubernetes-types
// declares Quantity as string, so `nvidia.com/gpu: 1`, valid Kubernetes,
// would otherwise hide every unknown field of its pod template).
function untypedLeaves(value) {
  if (Array.isArray(value)) return `[${value.map(untypedLeaves).join(",")}]`;
  if (value !== null && typeof value === "object") {
    return `{${Object.entries(value).map(([k, v]) => `${JSON.stringify(k)}:${untypedLeaves(v)}`).join(",\n")}}`;
  }
  return `(${JSON.stringify(value)} as any)`;
}

// Unknown fields of built-in kinds and of the Kubernetes parts of custom
// resources: each entry {value, types, type, label, where} becomes an object
// literal of type `type` from module `types`, and TypeScript reports a
// property its type does not declare (the first it meets in each entry: one
// unknown field per entry fails the entry, the next shows once it is fixed).
function unknownFieldErrors(entries) {
  if (entries.length === 0) return [];
  const imports = new Map();
  const lines = [];
  entries.forEach(({ value, types, type }, i) => {
    if (!imports.has(types)) imports.set(types, `T${imports.size}`);
    lines.push(`export const d${i}: ${imports.get(types)}.${type} = ${untypedLeaves(value)};`);
  });
  const source =
    [...imports].map(([mod, alias]) => `import type * as ${alias} from "${mod}";`).join("\n") + "\n" + lines.join("\n") + "\n";
  // A virtual file beside node_modules, so that module resolution finds it.
  const fileName = path.join(HERE, "__rendered_manifests__.ts");
  const options = { noEmit: true, strict: true, skipLibCheck: true, types: [], module: ts.ModuleKind.ESNext, moduleResolution: ts.ModuleResolutionKind.Bundler, target: ts.ScriptTarget.ES2022 };
  const host = ts.createCompilerHost(options);
  const getSourceFile = host.getSourceFile;
  host.getSourceFile = (name, lang, ...rest) =>
    name === fileName ? ts.createSourceFile(name, source, lang) : getSourceFile.call(host, name, lang, ...rest);
  const fileExists = host.fileExists;
  host.fileExists = (name) => name === fileName || fileExists.call(host, name);
  const readFile = host.readFile;
  host.readFile = (name) => (name === fileName ? source : readFile.call(host, name));
  const program = ts.createProgram([fileName], options, host);
  const errors = [];
  const starts = lines.map((_, i) => source.indexOf(`export const d${i}:`));
  for (const d of ts.getPreEmitDiagnostics(program)) {
    const message = ts.flattenDiagnosticMessageText(d.messageText, " ");
    if (d.file?.fileName !== fileName) {
      errors.push({ entry: null, message: `TypeScript: ${message}` });
      continue;
    }
    // 2353/2561: "Object literal may only specify known properties" (the
    // latter with "Did you mean"). Type mismatches are step 1's.
    if (d.code !== 2353 && d.code !== 2561) continue;
    let i = starts.length - 1;
    while (i > 0 && starts[i] > d.start) i--;
    errors.push({ entry: entries[i], message: `unknown field: ${message}` });
  }
  return errors;
}

// ---- pod templates and containers -------------------------------------------

// [path, pod spec, pod metadata] of every pod template of `doc`.
function podSpecs(doc) {
  const s = doc.spec ?? {};
  const template = (path, t) => (t?.spec ? [[`${path}.spec`, t.spec, t.metadata ?? {}]] : []);
  switch (doc.kind) {
    case "Pod":
      return [["spec", s, doc.metadata ?? {}]];
    case "StatefulSet":
    case "Deployment":
    case "DaemonSet":
    case "ReplicaSet":
    case "Job":
      return template("spec.template", s.template);
    case "CronJob":
      return template("spec.jobTemplate.spec.template", s.jobTemplate?.spec?.template);
    case "LeaderWorkerSet": {
      const t = s.leaderWorkerTemplate ?? {};
      return [
        ...template("spec.leaderWorkerTemplate.leaderTemplate", t.leaderTemplate),
        ...template("spec.leaderWorkerTemplate.workerTemplate", t.workerTemplate),
      ];
    }
    default:
      return [];
  }
}

function probeList(c) {
  return [
    ["startupProbe", c.startupProbe],
    ["livenessProbe", c.livenessProbe],
    ["readinessProbe", c.readinessProbe],
  ].filter(([, p]) => p);
}

const READINESS_SERVICE = "moe_ep.v1.Worker";

// The health service name a probe asks, or null when it asks none that we
// know (problems say why). gRPC probes: grpc.service; exec probes: the
// --service of their `moe-ep health` call.
function probeService(name, p, where, problems) {
  if (p.grpc) return p.grpc.service ?? "";
  if (!p.exec?.command) return null;
  const calls = argvInvocations(p.exec.command).invocations.filter((i) => i.bin === "moe-ep");
  if (calls.length === 0) return null;
  let service = null;
  for (const inv of calls) {
    const sub = inv.args.find((a) => !a.startsWith("-"));
    if (sub !== "health") {
      problems.push(`${where}: ${name} calls \`moe-ep ${sub ?? ""}\`, which depends on DNS and on the certificate's validity: probe the plaintext --health-listen port with \`moe-ep health --target 127.0.0.1:PORT\``);
      continue;
    }
    const target = flagValue(inv, "target") ?? "";
    const host = target.replace(/^"|"$/g, "").replace(/:[^:]*$/, "");
    if (!(host === "localhost" || /^127\./.test(host) || host === "[::1]")) {
      problems.push(`${where}: ${name} calls moe-ep health --target ${target}: use a loopback address (a name needs DNS)`);
    }
    service = flagValue(inv, "service") ?? "";
  }
  return service;
}

// `readiness`: the name that follows the group — the worker's
// "moe_ep.v1.Worker", or the coordinator's "moe_ep.v1.Coordinator" (SERVING
// only while the group is formed and matches its desired state).
function checkProbeSemantics(c, where, problems, readiness = READINESS_SERVICE) {
  for (const [name, p] of probeList(c)) {
    const service = probeService(name, p, where, problems);
    if (service === null) continue;
    const shown = service === "" ? '""' : `"${service}"`;
    if (name !== "readinessProbe" && service === readiness) {
      problems.push(`${where}: ${name} asks ${shown}, which follows the group (NOT_SERVING until formed and while broken): a pod would be restarted for the group's state; ask "" (liveness)`);
    }
    if (name === "readinessProbe" && service !== readiness) {
      problems.push(`${where}: readinessProbe asks ${shown}, which does not follow the group: ask "${readiness}"`);
    }
  }
}

const COORDINATOR_READINESS = "moe_ep.v1.Coordinator";
const isCoordinator = (inv) => inv.bin === "moe-ep" && inv.args.find((a) => !a.startsWith("-")) === "coordinator";

function checkFlags(inv, help, where, problems) {
  const h = help[inv.bin];
  let flags = h.flags;
  let label = inv.bin === "moe-ep-worker" ? "moe-ep-worker --help" : "moe-ep --help";
  let rest = inv.args;
  if (inv.bin === "moe-ep") {
    const subIndex = inv.args.findIndex((a) => !a.startsWith("-"));
    if (subIndex < 0) {
      problems.push(`${where}: moe-ep without a subcommand`);
      return;
    }
    const sub = inv.args[subIndex];
    if (!h.subcommands.has(sub)) {
      problems.push(`${where}: moe-ep has no subcommand "${sub}" (moe-ep --help lists ${[...h.subcommands.keys()].join(", ")})`);
      return;
    }
    for (const a of inv.args.slice(0, subIndex)) checkOne(a, h.flags, "moe-ep --help");
    flags = h.subcommands.get(sub).flags;
    label = `moe-ep ${sub} --help`;
    rest = inv.args.slice(subIndex + 1);
  }
  for (const a of rest) checkOne(a, flags, label);

  function checkOne(arg, known, source) {
    if (!arg.startsWith("--") || arg === "--") return;
    const name = arg.slice(2).split("=")[0];
    const kebab = name.replaceAll("_", "-");
    if (!known.has(name) && kebab !== name && known.has(kebab)) {
      problems.push(`${where}: flag --${name} of ${inv.bin} is a deprecated spelling: use --${kebab}`);
    } else if (!known.has(name)) {
      problems.push(`${where}: flag --${name} of ${inv.bin} is not in \`${source}\``);
    }
  }
}

// The value of flag --`name` in `inv` (--name=V or --name V), or null.
function flagValue(inv, name) {
  for (let i = 0; i < inv.args.length; i++) {
    const a = inv.args[i];
    if (a.startsWith(`--${name}=`)) return a.slice(name.length + 3);
    if (a === `--${name}` && i + 1 < inv.args.length) return inv.args[i + 1];
  }
  return null;
}

// The literal port of a host:port flag value, or null.
function literalPort(value) {
  const m = value?.match(/:(\d+)$/);
  return m ? Number(m[1]) : null;
}

// Where the kubelet's gRPC probes must go: the plaintext --health-listen
// port when the worker has one, else its --listen port (null: not literal).
function probePort(inv) {
  const health = flagValue(inv, "health-listen");
  return health !== null ? { port: literalPort(health), flag: "--health-listen" } : { port: literalPort(flagValue(inv, "listen")), flag: "--listen" };
}

// server/tls_credentials.h: plaintext only on a loopback --listen address
// unless --allow-insecure; a worker that breaks the rule exits at start-up.
function isLoopbackListen(value) {
  const host = (value ?? "127.0.0.1:0").replace(/:[^:]*$/, "");
  return host === "localhost" || /^127\./.test(host) || host === "[::1]" || host === "::1";
}
function hasFlag(inv, name) {
  return inv.args.some((a) => a === `--${name}` || a.startsWith(`--${name}=`));
}

function checkContainer(c, pod, where, ctx, problems) {
  const env = c.env ?? [];
  const envNames = new Set(env.map((e) => e.name));
  const argv = [...(c.command ?? (/(^|\/)moe-ep(:|@|$)/.test(c.image ?? "") ? IMAGE_ENTRYPOINT : [])), ...(c.args ?? [])];
  const main = argvInvocations(argv);
  const invocations = [...main.invocations];
  const scripts = [...main.scripts];
  const probeTexts = [];
  for (const [name, p] of probeList(c)) {
    if (p.exec?.command) {
      const r = argvInvocations(p.exec.command);
      invocations.push(...r.invocations);
      scripts.push(...r.scripts);
      probeTexts.push(p.exec.command.join(" "));
    }
    if (p.grpc) {
      const service = p.grpc.service ?? "";
      if (service !== "" && !ctx.grpcServices.has(service)) {
        problems.push(`${where}: ${name}.grpc.service "${service}" is not "" nor a service of proto/ (${[...ctx.grpcServices].join(", ")})`);
      }
      for (const inv of main.invocations.filter((i) => i.bin === "moe-ep-worker")) {
        const { port, flag } = probePort(inv);
        if (port !== null && p.grpc.port !== undefined && port !== p.grpc.port) {
          problems.push(`${where}: ${name}.grpc.port ${p.grpc.port} is not the worker's ${flag} port ${port}`);
        }
        if (flag === "--listen" && hasFlag(inv, "tls-cert")) {
          problems.push(`${where}: ${name} is a gRPC probe of a TLS port (the kubelet cannot do TLS): give the worker --health-listen and probe that port`);
        }
      }
    }
  }
  for (const inv of invocations) checkFlags(inv, ctx.help, `${where}: ${inv.bin}`, problems);
  if (main.invocations.some((i) => i.bin === "moe-ep-worker")) checkProbeSemantics(c, where, problems);
  // The coordinator service: the same rules with its own readiness name, and
  // gRPC probes on its plaintext --health-listen port.
  for (const inv of main.invocations.filter(isCoordinator)) {
    checkProbeSemantics(c, where, problems, COORDINATOR_READINESS);
    const health = literalPort(flagValue(inv, "health-listen"));
    for (const [name, p] of probeList(c)) {
      if (!p.grpc) continue;
      if (health === null) {
        problems.push(`${where}: ${name} is a gRPC probe of moe-ep coordinator without --health-listen (the kubelet cannot do TLS)`);
      } else if (p.grpc.port !== undefined && p.grpc.port !== health) {
        problems.push(`${where}: ${name}.grpc.port ${p.grpc.port} is not the coordinator's --health-listen port ${health}`);
      }
    }
  }

  // Kubernetes expands $(NAME) in command, args and env values; an unknown
  // name stays literally in the string, which is never what was meant.
  const k8sTexts = [...(c.command ?? []), ...(c.args ?? []), ...env.map((e) => e.value ?? "")];
  for (const t of k8sTexts) {
    for (const m of t.matchAll(/(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
      if (!envNames.has(m[1])) problems.push(`${where}: $(${m[1]}) is not an env variable of the container`);
    }
  }
  // Shell reads must be defined: env, runtime, or assigned by the script.
  for (const s of scripts) {
    const assigned = scriptAssigned(s);
    for (const name of scriptReads(s)) {
      if (!envNames.has(name) && !assigned.has(name) && !RUNTIME_ENV.has(name) && !(ctx.lws && LWS_ENV.has(name))) {
        problems.push(`${where}: the shell script reads ${name}, which is neither an env variable nor assigned in the script`);
      }
    }
  }
  // Every env variable must reach something that reads it.
  if (invocations.length > 0) {
    const used = [...k8sTexts, ...scripts, ...probeTexts].join("\n");
    const binTexts = [...new Set(invocations.map((i) => i.bin))].map((b) => ctx.help[b].text);
    for (const name of envNames) {
      const read =
        new RegExp(`\\$\\(${name}\\)|\\$\\{?${name}\\b`).test(used) ||
        scripts.some((s) => scriptReads(s).has(name)) ||
        binTexts.some((t) => new RegExp(`\\b${name}\\b`).test(t)) ||
        Object.hasOwn(ctx.libraryEnv, name);
      if (!read) {
        problems.push(
          `${where}: env ${name} is read by nothing: not used by the command, not in the help of ${[...new Set(invocations.map((i) => i.bin))].join(", ")}, not in deploy/validate/library-env.json`,
        );
      }
    }
  }

  // Transport security (server/tls_credentials.h): a worker on a
  // non-loopback address serves TLS or says --allow-insecure; the moe-ep
  // calls of a TLS worker's exec probes bring the CA and a client certificate.
  const workerInvs = main.invocations.filter((i) => i.bin === "moe-ep-worker");
  for (const inv of workerInvs) {
    const tls = hasFlag(inv, "tls-cert");
    if (!tls && !hasFlag(inv, "allow-insecure") && !isLoopbackListen(flagValue(inv, "listen"))) {
      problems.push(`${where}: moe-ep-worker listens on ${flagValue(inv, "listen") ?? "?"} in plaintext without --allow-insecure (it refuses to start): pass --tls-cert/--tls-key, or --allow-insecure on a trusted network`);
    }
    if (!tls) continue;
    const plaintextHealth = (i) => i.args.find((a) => !a.startsWith("-")) === "health";
    for (const probe of invocations.filter((i) => i.bin === "moe-ep" && !plaintextHealth(i))) {
      for (const f of ["tls-ca", hasFlag(inv, "tls-client-ca") ? "tls-cert" : null].filter(Boolean)) {
        if (!hasFlag(probe, f)) problems.push(`${where}: a probe calls the TLS worker with moe-ep but without --${f}`);
      }
    }
  }

  // DESIGN §12 for NCCL workers.
  const nccl = workerInvs.some((i) => i.args.some((a) => a === "--backend=nccl")) ;
  if (nccl) {
    const value = (n) => env.find((e) => e.name === n);
    if (value("NCCL_NVLS_ENABLE")?.value !== "0") problems.push(`${where}: NCCL worker without NCCL_NVLS_ENABLE=0 (DESIGN §11)`);
    if (pod.hostNetwork) {
      if (value("NCCL_HOSTID")?.valueFrom?.fieldRef?.fieldPath !== "spec.nodeName") {
        problems.push(`${where}: NCCL worker on the host network without NCCL_HOSTID from spec.nodeName (DESIGN §12)`);
      }
      if (!pod.hostIPC) problems.push(`${where}: NCCL worker on the host network without hostIPC (DESIGN §12)`);
    }
    if (!(c.securityContext?.capabilities?.add ?? []).includes("IPC_LOCK")) {
      problems.push(`${where}: NCCL worker without the IPC_LOCK capability (DESIGN §12)`);
    }
  }
}

// ---- pod security, labels, disruption budgets, metrics, group size -----------

const POD_SECURITY_ANNOTATION = "moe-ep/pod-security";

// The moe-ep invocations a container's own command runs (not its probes).
function containerInvocations(c) {
  const argv = [...(c.command ?? (/(^|\/)moe-ep(:|@|$)/.test(c.image ?? "") ? IMAGE_ENTRYPOINT : [])), ...(c.args ?? [])];
  return argvInvocations(argv).invocations;
}

// Check 6: Pod Security Standards "restricted" (kubernetes.io/docs/concepts/
// security/pod-security-standards), with the moe-ep/pod-security: privileged
// exemption of host namespaces, root and added capabilities.
function checkPodSecurity(pod, meta, where, problems) {
  const level = meta.annotations?.[POD_SECURITY_ANNOTATION];
  if (level !== undefined && level !== "privileged") {
    problems.push(`${where}: annotation ${POD_SECURITY_ANNOTATION} is "${level}": the only exemption is "privileged"`);
  }
  const exempt = level === "privileged";
  const broken = [];  // "restricted" rules the exemption covers and the pod breaks
  const psc = pod.securityContext ?? {};
  const containers = [...(pod.initContainers ?? []), ...(pod.containers ?? [])];
  if (pod.automountServiceAccountToken !== false) {
    problems.push(`${where}: automountServiceAccountToken is not false (moe-ep calls no Kubernetes API: the token would only be a credential to steal)`);
  }
  const seccompOk = (sc) => ["RuntimeDefault", "Localhost"].includes(sc?.seccompProfile?.type);
  if (!seccompOk(psc) && !containers.every((c) => seccompOk(c.securityContext))) {
    problems.push(`${where}: no seccompProfile RuntimeDefault (pod securityContext, or every container's): a "restricted" namespace rejects the pod`);
  }
  for (const f of ["hostNetwork", "hostPID", "hostIPC"]) if (pod[f]) broken.push(f);
  for (const v of pod.volumes ?? []) if (v.hostPath) broken.push(`hostPath volume ${v.name}`);
  for (const c of containers) {
    const sc = c.securityContext ?? {};
    const cw = `${where}.containers[${c.name}]`;
    if (sc.allowPrivilegeEscalation !== false) problems.push(`${cw}: securityContext.allowPrivilegeEscalation is not false`);
    if (sc.privileged) problems.push(`${cw}: securityContext.privileged is true`);
    if (!(sc.capabilities?.drop ?? []).includes("ALL")) problems.push(`${cw}: securityContext.capabilities.drop does not list ALL`);
    const added = (sc.capabilities?.add ?? []).filter((cap) => cap !== "NET_BIND_SERVICE");
    if (added.length > 0) broken.push(`${c.name} adds ${added.join(", ")}`);
    if (!(sc.runAsNonRoot ?? psc.runAsNonRoot)) broken.push(`${c.name} without runAsNonRoot`);
    if ((sc.runAsUser ?? psc.runAsUser) === 0) broken.push(`${c.name} runs as uid 0`);
    for (const port of c.ports ?? []) if (port.hostPort !== undefined) broken.push(`${c.name} hostPort ${port.hostPort}`);
  }
  if (!exempt && broken.length > 0) {
    problems.push(`${where}: not Pod Security "restricted": ${broken.join("; ")} (or annotate the pod ${POD_SECURITY_ANNOTATION}: privileged and say why)`);
  }
  if (exempt && broken.length === 0) {
    problems.push(`${where}: annotated ${POD_SECURITY_ANNOTATION}: privileged but meets "restricted": remove the annotation`);
  }
}

// Check 7: app.kubernetes.io/name and /instance on the object, its pod
// templates and its selectors (the object's own instance).
function checkLabels(doc, label, problems) {
  const want = ["app.kubernetes.io/name", "app.kubernetes.io/instance"];
  const own = doc.metadata?.labels ?? {};
  for (const k of want) if (!own[k]) problems.push(`${label}: metadata.labels has no ${k}`);
  const instance = own["app.kubernetes.io/instance"];
  for (const [podPath, , meta] of podSpecs(doc)) {
    for (const k of want) {
      if (!meta.labels?.[k]) problems.push(`${label}: ${podPath.replace(/\.spec$/, "")}.metadata.labels has no ${k}`);
    }
  }
  const selectors = [];
  if (doc.kind === "Service" && doc.spec?.selector) selectors.push(["spec.selector", doc.spec.selector]);
  if (doc.spec?.selector?.matchLabels) selectors.push(["spec.selector.matchLabels", doc.spec.selector.matchLabels]);
  for (const [path, sel] of selectors) {
    if (sel["app.kubernetes.io/instance"] !== instance) {
      problems.push(`${label}: ${path} does not select app.kubernetes.io/instance=${instance ?? "?"}: it would take another installation's pods`);
    }
  }
}

// Check 9: --metrics-listen and how Prometheus finds it.
function checkMetrics(pod, meta, where, problems) {
  const annotations = meta.annotations ?? {};
  const containers = [...(pod.initContainers ?? []), ...(pod.containers ?? [])];
  const declared = containers.flatMap((c) => c.ports ?? []);
  const metricsPorts = declared.filter((p) => /^metrics/.test(p.name ?? ""));
  let serves = false;
  for (const c of containers) {
    for (const inv of containerInvocations(c)) {
      if (!(inv.bin === "moe-ep-worker" || isCoordinator(inv))) continue;
      const name = inv.bin === "moe-ep-worker" ? "moe-ep-worker" : "moe-ep coordinator";
      const value = flagValue(inv, "metrics-listen");
      if (value === null) {
        problems.push(`${where}.containers[${c.name}]: ${name} without --metrics-listen (no /metrics to scrape)`);
        continue;
      }
      serves = true;
      if (pod.hostNetwork) continue;
      const port = literalPort(value);
      const own = (c.ports ?? []).filter((p) => /^metrics/.test(p.name ?? ""));
      if (port !== null && !own.some((p) => p.containerPort === port)) {
        problems.push(`${where}.containers[${c.name}]: ${name} serves /metrics on ${port}, which is no declared containerPort named metrics*`);
      } else if (port === null && own.length === 0) {
        problems.push(`${where}.containers[${c.name}]: ${name} serves /metrics, but the container declares no port named metrics*`);
      }
    }
  }
  const scrape = annotations["prometheus.io/scrape"];
  if (pod.hostNetwork) {
    for (const k of Object.keys(annotations).filter((k) => k.startsWith("prometheus.io/"))) {
      problems.push(`${where}: annotation ${k} on a host-network pod, which declares no port to scrape`);
    }
    return;
  }
  if (!serves) return;
  if (scrape !== "true") {
    problems.push(`${where}: serves /metrics but is not annotated prometheus.io/scrape: "true"`);
    return;
  }
  const port = annotations["prometheus.io/port"];
  if (port !== undefined) {
    if (!metricsPorts.some((p) => String(p.containerPort) === String(port))) {
      problems.push(`${where}: annotation prometheus.io/port "${port}" is no declared port named metrics*`);
    }
  } else {
    const other = declared.filter((p) => !/^metrics/.test(p.name ?? ""));
    if (other.length > 0) {
      problems.push(`${where}: prometheus.io/scrape without prometheus.io/port scrapes every declared port, and ${other.map((p) => p.name ?? p.containerPort).join(", ")} serve no /metrics`);
    }
  }
}

// Check 10, LeaderWorkerSet part: the group size comes from the controller.
function checkLwsGroupSize(pod, where, problems) {
  for (const c of [...(pod.initContainers ?? []), ...(pod.containers ?? [])]) {
    for (const e of c.env ?? []) {
      if (LWS_ENV.has(e.name) || /GROUP_SIZE/.test(e.name)) {
        problems.push(`${where}.containers[${c.name}]: env ${e.name} restates the group size or index: read LWS_GROUP_SIZE / LWS_WORKER_INDEX / LWS_LEADER_ADDRESS, which the LWS controller sets from leaderWorkerTemplate.size`);
      }
    }
    if (!containerInvocations(c).some(isCoordinator)) continue;
    const script = (c.args ?? []).join("\n") + (c.command ?? []).join("\n");
    for (const name of ["LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE"]) {
      if (!scriptReads(script).has(name)) {
        problems.push(`${where}.containers[${c.name}]: the coordinator's targets do not come from ${name}`);
      }
    }
  }
}

function podLabelsMatch(selector, labels) {
  return Object.entries(selector ?? {}).every(([k, v]) => labels?.[k] === v);
}

// Checks 8 and 10 across the documents of one render.
function checkRender(docs, problems) {
  const pdbs = docs.filter(({ doc }) => doc.kind === "PodDisruptionBudget");
  for (const { doc, label } of docs) {
    for (const [podPath, pod, meta] of podSpecs(doc)) {
      const runsWorker = (pod.containers ?? []).some((c) => containerInvocations(c).some((i) => i.bin === "moe-ep-worker"));
      if (!runsWorker) continue;
      if (!pdbs.some(({ doc: p }) => p.spec?.selector?.matchLabels && podLabelsMatch(p.spec.selector.matchLabels, meta.labels))) {
        problems.push(`${label}: ${podPath.replace(/\.spec$/, "")}: no PodDisruptionBudget selects these worker pods (a drain could evict every worker at once)`);
      }
    }
  }
  for (const { doc, label } of docs) {
    const text = doc.kind === "ConfigMap" ? doc.data?.["desired-state.json"] : undefined;
    if (typeof text !== "string") continue;
    let state;
    try {
      state = JSON.parse(text);
    } catch {
      continue;  // checkDesiredState reports it
    }
    const service = state.headless_service ?? state.headlessService;
    if (!service) continue;
    const sets = docs.filter(({ doc: d }) => d.kind === "StatefulSet" && d.spec?.serviceName === service.service);
    if (sets.length !== 1) {
      problems.push(`${label}: data/desired-state.json: headless_service.service "${service.service}" is the serviceName of ${sets.length} StatefulSets in this render, expected 1`);
      continue;
    }
    const replicas = sets[0].doc.spec?.replicas ?? 1;
    if (Number(service.replicas) !== replicas) {
      problems.push(`${label}: data/desired-state.json: headless_service.replicas ${JSON.stringify(service.replicas)} is not ${sets[0].label.replace(/^[^:]*: /, "")}'s spec.replicas ${replicas} (derive it: the replacements of deploy/k8s/base/kustomization.yaml)`);
    }
  }
}

// `moe-ep coordinator --state FILE --check` on a desired state's text.
function checkDesiredState(text, where, cliBin, problems) {
  const dir = fs.mkdtempSync(path.join(process.env.TMPDIR ?? "/tmp", "moe-ep-state-"));
  const file = path.join(dir, "desired-state.json");
  try {
    fs.writeFileSync(file, text);
    execFileSync(cliBin, ["coordinator", "--state", file, "--check"], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
  } catch (e) {
    const why = `${e.stderr ?? ""}${e.stdout ?? ""}`.trim().replaceAll(file, "FILE") || e.message;
    problems.push(`${where}: \`moe-ep coordinator --check\` rejects it: ${why}`);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

// ---- main ---------------------------------------------------------------------

function grpcServicesOf(protoDir) {
  const services = new Set(["grpc.health.v1.Health"]);
  const walk = (dir) => {
    for (const e of fs.readdirSync(dir, { withFileTypes: true })) {
      const p = path.join(dir, e.name);
      if (e.isDirectory()) walk(p);
      else if (e.name.endsWith(".proto")) {
        const text = fs.readFileSync(p, "utf8");
        const pkg = text.match(/^\s*package\s+([\w.]+)\s*;/m)?.[1];
        for (const m of text.matchAll(/^\s*service\s+(\w+)\s*\{/gm)) services.add(pkg ? `${pkg}.${m[1]}` : m[1]);
      }
    }
  };
  walk(protoDir);
  return services;
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const ctx = {
    help: loadHelp(opts.worker, opts.cli),
    grpcServices: grpcServicesOf(opts["proto-dir"]),
    libraryEnv: JSON.parse(fs.readFileSync(path.join(HERE, "library-env.json"), "utf8")),
  };
  const crdValidators = await loadCrdValidators(opts.schemas);
  const problems = [];
  const typed = [];  // entries for unknownFieldErrors
  let count = 0;
  for (const file of opts.files) {
    const docs = YAML.parseAllDocuments(fs.readFileSync(file, "utf8"));
    const renderDocs = [];  // this render's documents, for checkRender
    for (const d of docs) {
      if (d.errors.length > 0) {
        problems.push(`${file}: YAML: ${d.errors[0].message}`);
        continue;
      }
      const doc = d.toJS();
      if (doc === null) continue;
      count++;
      const label = `${file}: ${doc.kind ?? "?"}/${doc.metadata?.name ?? "?"}`;
      if (typeof doc.apiVersion !== "string" || typeof doc.kind !== "string") {
        problems.push(`${label}: apiVersion and kind are required strings`);
        continue;
      }
      const crd = crdValidators.get(`${doc.apiVersion}/${doc.kind}`);
      if (crd) {
        typedParts.length = 0;
        if (!crd(doc)) for (const e of crd.errors) problems.push(`${label}: ${ajvMessage(e)}`);
        for (const p of typedParts) typed.push({ ...p, label });
      } else {
        const cls = await modelClass(doc.apiVersion, doc.kind);
        if (!cls) {
          problems.push(`${label}: no schema for ${doc.apiVersion} ${doc.kind} (not a built-in kind nor in deploy/schemas)`);
          continue;
        }
        try {
          new cls(doc).validate();
        } catch (e) {
          // kubernetes-models joins its errors: "data/a must ..., data/b ...".
          for (const part of String(e.message).split(/,\s*(?=data[/\s])|\n/)) {
            problems.push(`${label}: ${part.trim().replace(/^data/, "") || "/"}`);
          }
        }
        typed.push({ value: doc, types: typesModule(doc.apiVersion), type: doc.kind, label, where: "" });
      }
      if (doc.kind === "ConfigMap" && typeof doc.data?.["desired-state.json"] === "string") {
        checkDesiredState(doc.data["desired-state.json"], `${label}: data/desired-state.json`, opts.cli, problems);
      }
      const podCtx = { ...ctx, lws: doc.kind === "LeaderWorkerSet" };
      for (const [podPath, pod, meta] of podSpecs(doc)) {
        for (const kind of ["initContainers", "containers"]) {
          for (const c of pod[kind] ?? []) {
            checkContainer(c, pod, `${label}: ${podPath}.${kind}[${c.name}]`, podCtx, problems);
          }
        }
        checkPodSecurity(pod, meta, `${label}: ${podPath}`, problems);
        checkMetrics(pod, meta, `${label}: ${podPath}`, problems);
        if (podCtx.lws) checkLwsGroupSize(pod, `${label}: ${podPath}`, problems);
      }
      checkLabels(doc, label, problems);
      renderDocs.push({ doc, label });
    }
    checkRender(renderDocs, problems);
  }
  for (const e of unknownFieldErrors(typed)) {
    problems.push(e.entry ? `${e.entry.label}: ${e.entry.where ? `${e.entry.where}: ` : ""}${e.message}` : `?: ${e.message}`);
  }

  for (const p of problems) console.log(`FAIL ${p}`);
  console.log(`${count} documents in ${opts.files.length} renders: ${problems.length === 0 ? "valid" : `${problems.length} problems`}`);
  process.exit(problems.length === 0 ? 0 : 1);
}

main().catch((e) => {
  console.error(`validate-manifests: ${e.stack ?? e}`);
  process.exit(2);
});
