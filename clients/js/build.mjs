// Builds dist/realtime.js (one minified ES module), its declarations (dist/types), and
// build/lib (each source file as plain ES modules, for the unit tests). Prints the sizes.
import { build } from "esbuild";
import { execFileSync } from "node:child_process";
import { readdirSync, readFileSync, rmSync } from "node:fs";
import { gzipSync } from "node:zlib";

process.chdir(new URL(".", import.meta.url).pathname);
rmSync("dist", { recursive: true, force: true });
rmSync("build", { recursive: true, force: true });

const common = { target: "es2020", format: "esm", logLevel: "warning" };
await build({
  ...common,
  entryPoints: ["src/index.ts"],
  outfile: "dist/realtime.js",
  bundle: true,
  minify: true,
  sourcemap: true,
  legalComments: "none",
});
await build({
  ...common,
  entryPoints: readdirSync("src").map((name) => `src/${name}`),
  outdir: "build/lib",
});
execFileSync(
  process.execPath,
  ["node_modules/typescript/bin/tsc", "-p", "tsconfig.json", "--emitDeclarationOnly"],
  {
    stdio: "inherit",
  },
);

const bundle = readFileSync("dist/realtime.js");
const sizes = { minified: bundle.length, gzip: gzipSync(bundle, { level: 9 }).length };
console.log(JSON.stringify(sizes));
