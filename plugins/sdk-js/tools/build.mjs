// Builds TypeScript Capstan plugins: the contract's types from wit/capstan.wit, bundles,
// and components. `cargo xtask plugins` and `cargo xtask test` run it; so can you:
//
//   node plugins/sdk-js/tools/build.mjs types
//   node plugins/sdk-js/tools/build.mjs component plugins/greeting-ts target/plugins/greeting-ts.wasm
//   node plugins/sdk-js/tools/build.mjs tests plugins/sdk-js plugins/greeting-ts target/js/tests
//
// Packages come from plugins/sdk-js/node_modules (`npm ci` there, or the xtask's cached
// install linked there), at the exact versions of package-lock.json.

import { mkdir, readdir, rename, rm, writeFile } from 'node:fs/promises';
import { basename, dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

import { componentize } from '@bytecodealliance/componentize-js';
import { types } from '@bytecodealliance/jco';
import { _setPreopens } from '@bytecodealliance/preview2-shim/filesystem';
import { build } from 'esbuild';

const SDK = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const ROOT = resolve(SDK, '../..');
/** The contract: read from its one place in the repository, never copied. */
const WIT = join(ROOT, 'wit');
const WORLD = 'plugin';
/** Where the generated declarations go (ignored by git, made by `types`). */
const GENERATED = join(SDK, 'generated');

/**
 * Features of the StarlingMonkey engine left out of every plugin. `http` and `fetch-event`
 * would make the component import `wasi:http`, which the host does not provide (it refuses
 * such a component at load). Kept: stdio (console.* goes to the host's log), random
 * (Math.random, crypto.getRandomValues) and clocks (Date.now).
 */
const DISABLED_FEATURES = ['http', 'fetch-event'];

// jco's and componentize-js's WIT readers are components run by preview2-shim, which
// since 0.26 grants them no directory unless asked (the cause of `jco componentize`'s
// "failed to get path metadata (os error 44)"): grant them the WIT directory only.
_setPreopens({ [WIT]: WIT });

const commands = {
  /** Declarations of the contract's interfaces, for TypeScript. */
  async types() {
    const files = await types(WIT, { worldName: WORLD, guest: true, outDir: '', quiet: true });
    await rm(GENERATED, { recursive: true, force: true });
    for (const [name, bytes] of Object.entries(files)) {
      const path = join(GENERATED, name);
      await mkdir(dirname(path), { recursive: true });
      await writeFile(path, bytes);
    }
    console.log(`types: ${Object.keys(files).length} files in ${GENERATED}`);
  },

  /** `<project> <out.wasm>`: bundles `<project>/src/index.ts` and componentizes it. */
  async component(project, out) {
    if (!project || !out) {
      throw new Error('usage: component <project dir> <out.wasm>');
    }
    const work = resolve(out + '.build');
    await rm(work, { recursive: true, force: true });
    await mkdir(work, { recursive: true });
    const bundle = join(work, 'plugin.js');
    await bundleFiles([join(resolve(project), 'src/index.ts')], work, {
      platform: 'neutral',
      // The contract's interfaces are the component's imports, not modules to bundle.
      external: ['capstan:*'],
      entryNames: 'plugin',
    });
    const started = Date.now();
    const { component } = await componentize({
      sourcePath: bundle,
      witPath: WIT,
      worldName: WORLD,
      disableFeatures: DISABLED_FEATURES,
    });
    await mkdir(dirname(resolve(out)), { recursive: true });
    const tmp = resolve(out + '.tmp');
    await writeFile(tmp, component);
    await rename(tmp, resolve(out));
    await rm(work, { recursive: true, force: true });
    const mib = (component.length / (1 << 20)).toFixed(1);
    console.log(`component: ${out} (${mib} MiB, componentized in ${((Date.now() - started) / 1000).toFixed(1)} s)`);
  },

  /** `<project>... <out dir>`: bundles every `<project>/test/*.test.ts` for `node --test`. */
  async tests(...args) {
    const out = args.pop();
    if (!out || args.length === 0) {
      throw new Error('usage: tests <project dir>... <out dir>');
    }
    await rm(resolve(out), { recursive: true, force: true });
    for (const project of args) {
      const dir = join(resolve(project), 'test');
      const entries = (await readdir(dir)).filter((f) => f.endsWith('.test.ts')).map((f) => join(dir, f));
      await bundleFiles(entries, join(resolve(out), basename(resolve(project))), {
        platform: 'node',
        outExtension: { '.js': '.mjs' },
      });
    }
  },
};

/** Bundles TypeScript with esbuild, which resolves `@capstan/sdk` through tsconfig paths. */
async function bundleFiles(entryPoints, outdir, options) {
  await build({
    entryPoints,
    outdir,
    bundle: true,
    format: 'esm',
    target: 'es2022',
    logLevel: 'warning',
    ...options,
  });
}

const [command, ...args] = process.argv.slice(2);
if (!Object.hasOwn(commands, command ?? '')) {
  console.error(`usage: build.mjs ${Object.keys(commands).join('|')} ...`);
  process.exit(2);
}
await commands[command](...args);
