// Builds TypeScript Capstan plugins: the contract's types from its WIT, type checks,
// bundles and components. `capstan build` runs it from the pinned toolchain it installs
// (as `capstan-js`), and so does `cargo xtask` for this repository's plugins:
//
//   capstan-js check <project>
//   capstan-js component <project> <out.wasm> [<wit dir>]
//   capstan-js types <wit dir> <out dir>
//   capstan-js tests <project>... <out dir>
//
// Its packages (componentize-js, jco, esbuild, TypeScript) resolve from the directory
// this file is in: the toolchain's, at the exact versions of the SDK's package-lock.json.
// The project's own `@capstan/sdk` resolves from the project (its node_modules, or
// tsconfig paths in this repository).

import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { appendFile, mkdir, readdir, readFile, rename, rm, writeFile } from 'node:fs/promises';
import { basename, dirname, join, relative, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

import { componentize } from '@bytecodealliance/componentize-js';
import { types } from '@bytecodealliance/jco';
import { _setPreopens } from '@bytecodealliance/preview2-shim/filesystem';
import { build } from 'esbuild';

/**
 * A file of an installed package, found as Node finds packages (the node_modules of this
 * file's directory, then of each parent): for files a package's `exports` do not list,
 * such as TypeScript's `bin/tsc`.
 */
function packageFile(name, file) {
  for (let dir = dirname(fileURLToPath(import.meta.url)); ; dir = dirname(dir)) {
    const path = join(dir, 'node_modules', name, file);
    if (existsSync(path)) {
      return path;
    }
    if (dirname(dir) === dir) {
      throw new Error(`${name} is not installed beside ${fileURLToPath(import.meta.url)}`);
    }
  }
}
const WORLD = 'plugin';

/**
 * Features of the StarlingMonkey engine left out of every plugin. `http` and `fetch-event`
 * would make the component import `wasi:http`, which the host does not provide (it refuses
 * such a component at load). Kept: stdio (console.* goes to the host's log), random
 * (Math.random, crypto.getRandomValues) and clocks (Date.now).
 */
const DISABLED_FEATURES = ['http', 'fetch-event'];

/**
 * jco's and componentize-js's WIT readers are components run by preview2-shim, which
 * since 0.26 grants them no directory unless asked (the cause of `jco componentize`'s
 * "failed to get path metadata (os error 44)"): grant them the WIT directory only.
 */
function witDir(dir) {
  const wit = resolve(dir);
  if (!existsSync(join(wit, 'capstan.wit'))) {
    throw new Error(`no capstan.wit in ${wit}: is @capstan/sdk installed (npm install)?`);
  }
  _setPreopens({ [wit]: wit });
  return wit;
}

const commands = {
  /** `<wit dir> <out dir>`: declarations of the contract's interfaces, for TypeScript. */
  async types(wit, outDir) {
    if (!wit || !outDir) {
      throw new Error('usage: types <wit dir> <out dir>');
    }
    const files = await types(witDir(wit), { worldName: WORLD, guest: true, outDir: '', quiet: true });
    const generated = resolve(outDir);
    await rm(generated, { recursive: true, force: true });
    for (const [name, bytes] of Object.entries(files)) {
      const path = join(generated, name);
      await mkdir(dirname(path), { recursive: true });
      await writeFile(path, bytes);
    }
    console.log(`types: ${Object.keys(files).length} files in ${generated}`);
  },

  /** `<project>...`: type-checks each project with its tsconfig.json (`tsc --noEmit`). */
  async check(...projects) {
    if (projects.length === 0) {
      throw new Error('usage: check <project dir>...');
    }
    const tsc = packageFile('typescript', 'bin/tsc');
    for (const project of projects) {
      const run = spawnSync(process.execPath, [tsc, '--pretty', 'false', '-p', resolve(project)], { stdio: 'inherit' });
      if (run.status !== 0) {
        throw new Error(`type errors in ${project} (tsc exited with ${run.status ?? run.signal})`);
      }
    }
  },

  /**
   * `<project> <out.wasm> [<wit dir>]`: bundles `<project>/src/index.ts` and
   * componentizes it against the contract's WIT (by default the one the project's
   * `@capstan/sdk` ships).
   */
  async component(project, out, wit) {
    if (!project || !out) {
      throw new Error('usage: component <project dir> <out.wasm> [<wit dir>]');
    }
    const witPath = witDir(wit ?? join(resolve(project), 'node_modules/@capstan/sdk/wit'));
    const work = resolve(out + '.build');
    await rm(work, { recursive: true, force: true });
    await mkdir(work, { recursive: true });
    const bundle = join(work, 'plugin.js');
    await bundleFiles([join(resolve(project), 'src/index.ts')], work, {
      platform: 'neutral',
      // The contract's interfaces are the component's imports, not modules to bundle.
      external: ['capstan:*'],
      entryNames: 'plugin',
      sourcemap: 'external',
      sourcesContent: false,
    });
    await appendSourceMap(bundle, resolve(project));
    const started = Date.now();
    const { component } = await componentize({
      sourcePath: bundle,
      witPath,
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

/**
 * Appends the bundle's source map to the bundle, as `globalThis.__capstanSourceMap`, with
 * its sources relative to the project (`src/plugin.ts`): the SDK maps a bug's stack
 * through it before logging it (src/sourcemap.ts). Appended, so no line of the bundle
 * moves.
 */
async function appendSourceMap(bundle, project) {
  const map = JSON.parse(await readFile(`${bundle}.map`, 'utf8'));
  const sources = map.sources.map((s) => relative(project, resolve(dirname(bundle), s)));
  const kept = JSON.stringify({ sources, mappings: map.mappings });
  await appendFile(bundle, `\nglobalThis.__capstanSourceMap = ${kept};\n`);
}

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
  console.error(`usage: capstan-js ${Object.keys(commands).join('|')} ...`);
  process.exit(2);
}
try {
  await commands[command](...args);
} catch (e) {
  // One line: what failed and why (esbuild and tsc have printed their own details).
  console.error(`capstan-js ${command}: ${e instanceof Error ? e.message : e}`);
  process.exit(1);
}
