import time,torch,sys,copy,importlib.util
from dflash_trt.api import load_target
from dflash_trt.modeling.target import TargetModel
spec=importlib.util.spec_from_file_location('old_target','/tmp/perf/old_target.py'); old=importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
torch.set_num_threads(int(sys.argv[2]))
t,_=load_target(sys.argv[1],dtype='float32',progress=False, packed=False)
from dflash_trt.modeling.cpu_pack import pack_target
tp=copy.deepcopy(t); pack_target(tp)
variants={'old-dense':old.TargetModel(t.hf),'new-dense':TargetModel(t.hf),'old-packed':old.TargetModel(tp.hf),'new-packed':TargetModel(tp.hf)}
def mk(m):
  cache=m.new_cache(1,512)
  out=m.prefill([list(range(100))],cache); tok=out.logits[:,-1].argmax(-1)
  st={'tok':tok}
  def step():
    o=m.forward(st['tok'][:,None],cache); st['tok']=o.logits[:,-1].argmax(-1)
    cache.crop(cache.lengths-1)
    return o.logits
  return step
fs={k:mk(m) for k,m in variants.items()}
ref={k:f() for k,f in fs.items()}
print('max |diff| new vs old dense', (ref['new-dense']-ref['old-dense']).abs().max().item(), 'packed', (ref['new-packed']-ref['old-packed']).abs().max().item())
res={k:[] for k in fs}
for r in range(int(sys.argv[3])):
  for k,f in fs.items():
    c=time.process_time(); s=time.perf_counter()
    for _ in range(3): f()
    res[k].append(((time.process_time()-c)/3*1e3,(time.perf_counter()-s)/3*1e3))
for k,v in res.items(): print(k, 'cpu ms', sorted(round(a,1) for a,_ in v), 'wall', sorted(round(b) for _,b in v))
